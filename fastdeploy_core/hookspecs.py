"""The plugin contract of fastdeploy-core. Read this first.

A plugin is a Python package with an entry point in the group ``fastdeploy``::

    [project.entry-points.fastdeploy]
    mychip = "fd_mychip"

The module named there declares ``FD_PLUGIN_API_VERSION = 1`` (see
:data:`fastdeploy_core.PLUGIN_API_VERSION`) and holds functions decorated with
``@hookimpl``. Each hook receives a ``register`` callback, so a plugin never imports or
mutates core registries. The core's own built-ins (the cpu device, ...) register through the
same hooks (:mod:`fastdeploy_core.builtin`).

Registering a name that another plugin already registered is an error naming both
distributions. A hook implementation may accept fewer arguments than the spec, so the
contract can grow without breaking plugins.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "fastdeploy"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_devices(register):
    """Register device classes.

    Call ``register(DeviceClass)`` for each :class:`fastdeploy_core.devices.Device` subclass;
    its ``name`` (``"gpu"``, ``"xpu"``, ...) is the key for ``--device``.
    """


@hookspec
def register_models(register):
    """Register model implementations for checkpoint architectures.

    Call ``register(architecture, target, impl="fastdeploy")`` where ``architecture`` is a
    Hugging Face ``architectures[0]`` string (or ``"*"`` for a provider that decides per
    config, like the PaddleFormers fallback), ``target`` is ``"module:Class"`` (imported only
    when that model is loaded) or the class itself, and ``impl`` is ``"fastdeploy"`` (native)
    or ``"paddleformers"`` (fallback).
    """


@hookspec
def register_quantizers(register):
    """Register quantization methods: ``register("wint8", QuantizerClass)``."""


@hookspec
def register_schedulers(register):
    """Register request-level schedulers: ``register("global", SchedulerClass)``."""


@hookspec
def register_commands(app):
    """Add sub-commands to the ``fastdeploy`` typer application ``app``."""
