"""``--guided-decoding-backend auto|guidance|xgrammar|off|NAME``: the backend class from the plugins.

``auto`` takes ``guidance`` when it is registered, else the first registered backend by name;
``off`` turns structured output off (requests asking for it get a 400 saying so).
"""

from __future__ import annotations

from fastdeploy_core.errors import ConfigError
from fastdeploy_core.guided.backend import GuidedBackend

#: The backend ``auto`` prefers.
PREFERRED = ("guidance",)
#: Names FastDeploy accepts that no installed plugin may provide, with what to install.
KNOWN_PACKAGES = {"xgrammar": "a plugin registering the xgrammar backend (it needs torch and xgrammar)"}


def guided_backend_class(name: str, plugin_manager=None) -> type[GuidedBackend] | None:
    """The registered class for ``name`` (None for ``off``); ConfigError listing the choices."""
    if name == "off":
        return None
    from fastdeploy_core.plugins import get_plugin_manager, import_target

    pm = plugin_manager or get_plugin_manager()
    registry = pm.guided_backends
    if name == "auto":
        names = [n for n in PREFERRED if n in registry] + sorted(n for n in registry.keys() if n not in PREFERRED)  # noqa: SIM118 - a Registry, not a dict
        if not names:
            return None
        name = names[0]
    target = registry.get(name)
    if target is None:
        known = ", ".join(["auto", "off", *sorted(registry.keys())])
        hint = f"; install {KNOWN_PACKAGES[name]}" if name in KNOWN_PACKAGES else ""
        raise ConfigError(
            f"guided_decoding_backend: {name!r} is not registered (choose one of {known}){hint}",
            param="guided_decoding_backend",
        )
    return import_target(target)
