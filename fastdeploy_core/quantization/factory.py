"""Build a registered quantization method by name (the registry of the plugin manager).

The one place that turns a method name into an instance: :mod:`~fastdeploy_core.quantization.registry`
uses it for ``--quantization``, composite methods (``mix_quant``) for their parts, and
:class:`~fastdeploy_core.quantization.base.QuantizerBase` for the LM head's method, so the base
never imports a method derived from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastdeploy_core.errors import QuantizationError

if TYPE_CHECKING:
    from fastdeploy_core.quantization.base import QuantizerBase


def _registry(plugin_manager):
    if plugin_manager is None:
        from fastdeploy_core.plugins import get_plugin_manager

        plugin_manager = get_plugin_manager()
    return plugin_manager


def build_quantizer(name: str, settings: dict, plugin_manager, lenient: bool = False) -> QuantizerBase:
    """Instantiate the registered method ``name`` with ``settings``.

    ``lenient`` drops settings the method does not declare (a checkpoint's config carries
    fields such as ``activation_scheme`` we have no use for); user-given settings stay strict.
    """
    pm = _registry(plugin_manager)
    cls = pm.quantizers.get(name)
    if isinstance(cls, str):
        from fastdeploy_core.plugins import import_target

        cls = import_target(cls)
    if cls is None:
        registered = ", ".join(sorted(pm.quantizers.keys())) or "none"
        raise QuantizationError(
            f"unknown quantization method {name!r}; registered methods: {registered} "
            "(a plugin providing another method must be installed and allowed by FD_PLUGINS)",
            param="quantization",
        )
    if lenient:
        fields = getattr(cls.config_class, "model_fields", {})
        settings = {k: v for k, v in settings.items() if k in fields}

    def resolver(part: str, shared: dict | None = None) -> QuantizerBase:
        return build_quantizer(part, dict(shared or {}), pm, lenient=lenient)

    return cls.from_config(settings, resolver=resolver)
