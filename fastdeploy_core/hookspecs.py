"""The plugin contract of fastdeploy-core. Read this first.

A plugin is a Python package with an entry point in the group ``fastdeploy``::

    [project.entry-points.fastdeploy]
    mychip = "fd_mychip"

The module named there declares ``FD_PLUGIN_API_VERSION = 1`` (see
:data:`fastdeploy_core.PLUGIN_API_VERSION`) and holds functions decorated with
``@hookimpl``. Each hook receives a ``register`` callback, so a plugin never imports or
mutates core registries. The core's own built-ins (the cpu device, ...) register through the
same hooks (:mod:`fastdeploy_core.builtin`).

A model plugin also declares the GGUF architectures it reads (``register_models`` with
``gguf=GGUFArchitecture(...)``): the core's GGUF loader holds no model knowledge of its own.

Registering a name that another plugin already registered is an error naming both
distributions. A hook implementation may accept fewer arguments than the spec, so the
contract can grow without breaking plugins.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class GGUFArchitecture:
    """How a GGUF file of one ``general.architecture`` becomes an HF-style checkpoint.

    Passed as ``register(architecture, target, gguf=GGUFArchitecture(...))`` so the GGUF
    loader stays free of model knowledge: it reads files and blocks, the model plugin says
    what the names and numbers mean. Each of the three parts is the object itself or a
    ``"module:attr"`` string imported only when a GGUF file of this architecture is opened
    (registration then imports nothing heavy).

    * ``name``: the GGUF ``general.architecture`` value (``"llama"``).
    * ``tensor_names``: GGUF tensor name without its ``.weight``/``.bias`` suffix -> HF name
      without it; ``{bid}`` stands for the layer number (``"blk.{bid}.attn_q"`` ->
      ``"model.layers.{bid}.self_attn.q_proj"``); ``None`` skips a tensor. Unlisted tensors
      pass through under their GGUF name, so the model reports them.
    * ``hf_config(gguf_file) -> dict``: the HF ``config.json`` keys from a
      :class:`fastdeploy_core.loader.gguf_loader.GGUFFile` (metadata, tensor shapes, small
      tensors). The loader adds ``architectures`` and the tokenizer's special token ids.
    * ``row_order(hf_name, rows, hf_config) -> index array | None``: the order in which to take
      a tensor's rows (axis 0, HF ``[out, in]`` orientation), e.g. undoing llama.cpp's
      interleaved-RoPE row permutation of the query/key projections. A reordering of whole
      rows applies to dequantized arrays and to raw quantized blocks alike.
    """

    name: str
    tensor_names: Mapping[str, str | None] | str
    hf_config: Callable[[Any], dict] | str
    row_order: Callable[[str, int, dict], Any] | str | None = None


@hookspec
def register_models(register):
    """Register model implementations for checkpoint architectures.

    Call ``register(architecture, target, impl="fastdeploy")`` where ``architecture`` is a
    Hugging Face ``architectures[0]`` string (or ``"*"`` for a provider that decides per
    config, like the PaddleFormers fallback), ``target`` is ``"module:Class"`` (imported only
    when that model is loaded) or the class itself, and ``impl`` is ``"fastdeploy"`` (native)
    or ``"paddleformers"`` (fallback).

    A plugin whose architecture is also published as GGUF files adds
    ``gguf=GGUFArchitecture(...)`` (see :class:`GGUFArchitecture`): GGUF files whose
    ``general.architecture`` is that name then load as ``architecture``. Each GGUF name is
    registered once; the core's GGUF loader knows no architecture of its own.
    """


@hookspec
def register_quantizers(register):
    """Register quantization methods: ``register("wint8", QuantizerClass)``."""


@hookspec
def register_schedulers(register):
    """Register request-level schedulers: ``register("global", SchedulerClass)``."""


@hookspec
def register_router_policies(register):
    """Register routing policies of ``fastdeploy router``: ``register("mine", PolicyClass)``.

    The name is what ``--policy`` / ``--prefill-policy`` / ``--decode-policy`` take; the class
    (or a ``"module:Class"`` string, imported only when chosen) subclasses
    :class:`fastdeploy_core.router.policies.Policy` and is built with no arguments, one
    instance per policy flag for the router's lifetime.
    """


@hookspec
def register_proposers(register):
    """Register speculative-decoding proposers: ``register("ngram", ProposerClass)``.

    The name is the ``method`` of ``--speculative-config``; the class (or a ``"module:Class"``
    string, imported only when that method is configured) subclasses
    :class:`fastdeploy_core.spec_decode.base.Proposer`. A proposer only guesses the next tokens
    of each decoding request; the engine has the target model score every guess in the same
    batched step and keeps the longest prefix the target agrees with, so a proposer can change
    speed, never the output.
    """


@hookspec
def register_guided_backends(register):
    """Register guided-decoding backends: ``register("guidance", "module:BackendClass")``.

    The class subclasses :class:`fastdeploy_core.guided.backend.GuidedBackend` (compile a
    constraint for the engine's tokenizer, hand out per-request matchers that fill numpy int32
    bitmasks); its name is a value of ``--guided-decoding-backend``. A ``"module:Class"`` target
    is imported only when that backend is chosen.
    """


@hookspec
def register_tool_parsers(register):
    """Register tool-call parsers: ``register("hermes", "module:ParserClass")``.

    The class subclasses :class:`fastdeploy_core.entrypoints.openai.tool_parsers.ToolParser`
    (find the tool calls in a model's text, whole or streamed); its name is a value of
    ``--tool-call-parser``.
    """


@hookspec
def register_reasoning_parsers(register):
    """Register reasoning parsers: ``register("qwen3", "module:ParserClass")``.

    The class subclasses
    :class:`fastdeploy_core.entrypoints.openai.reasoning_parsers.ReasoningParser` (split a
    model's reply into its reasoning and its answer, whole or streamed); its name is a value of
    ``--reasoning-parser``. A ``"module:Class"`` target is imported only when that parser is chosen.
    """


@hookspec
def register_commands(app):
    """Add sub-commands to the ``fastdeploy`` typer application ``app``."""
