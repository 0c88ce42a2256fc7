"""Plugin discovery and the typed registries built from the hooks in :mod:`hookspecs`.

Discovery: every entry point in the group ``fastdeploy`` (``importlib.metadata``), filtered by
the ``FD_PLUGINS`` allow-list — a comma-separated list of entry-point names; unset loads all,
an empty string loads none but the core's built-ins. A plugin that fails to import, or that
declares another ``FD_PLUGIN_API_VERSION``, is reported (warning + ``failed`` list) and the
rest keep working; asking for something it would have provided raises its error.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

import pluggy

from fastdeploy_core import PLUGIN_API_VERSION, __version__, hookspecs
from fastdeploy_core.errors import (
    DeviceUnavailableError,
    DuplicateRegistrationError,
    PluginAPIVersionError,
    PluginError,
    UnsupportedArchitectureError,
)

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "fastdeploy"
ALLOW_LIST_ENV = "FD_PLUGINS"
CORE_DISTRIBUTION = "fastdeploy-core"

#: Device name -> the package that provides it, for "install X" messages.
KNOWN_DEVICE_PACKAGES = {
    "gpu": "fd-nvidia",
    "xpu": "fd-kunlunxin",
    "dcu": "fd-hygon",
    "iluvatar_gpu": "fd-iluvatar",
    "gcu": "fd-enflame",
    "metax_gpu": "fd-metax",
    "intel_hpu": "fd-gaudi",
}

#: GGUF ``general.architecture`` -> the model plugin that registers it, for "install X" messages.
KNOWN_GGUF_PACKAGES = {"llama": "fd-llama"}

HOOK_NAMES = (
    "register_devices",
    "register_models",
    "register_quantizers",
    "register_schedulers",
    "register_proposers",
    "register_router_policies",
    "register_guided_backends",
    "register_tool_parsers",
    "register_reasoning_parsers",
)

T = TypeVar("T")


@dataclass
class PluginInfo:
    """One loaded plugin and what it registered under each hook."""

    name: str
    distribution: str
    version: str
    module: str
    registered: dict[str, list[str]] = field(default_factory=lambda: {h: [] for h in HOOK_NAMES})
    #: ``"gguf_name -> HFArchitecture"`` for each GGUF architecture given to ``register_models``
    gguf_architectures: list[str] = field(default_factory=list)


@dataclass
class FailedPlugin:
    """A plugin that could not be used, and why."""

    name: str
    distribution: str
    version: str
    error: str


@dataclass
class Entry(Generic[T]):
    value: T
    plugin: str
    distribution: str


class Registry(Generic[T]):
    """Name -> value, remembering which plugin registered each name."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[Any, Entry[T]] = {}

    def add(self, key: Any, value: T, plugin: PluginInfo) -> None:
        if key in self._entries:
            other = self._entries[key]
            raise DuplicateRegistrationError(
                f"{self.kind} {key!r} is registered twice: by {other.distribution} "
                f"(plugin {other.plugin!r}) and by {plugin.distribution} (plugin {plugin.name!r}); "
                f"uninstall one of them or leave one out with {ALLOW_LIST_ENV}"
            )
        self._entries[key] = Entry(value, plugin.name, plugin.distribution)

    def get(self, key: Any) -> T | None:
        entry = self._entries.get(key)
        return entry.value if entry else None

    def entry(self, key: Any) -> Entry[T] | None:
        return self._entries.get(key)

    def keys(self) -> list[Any]:
        return list(self._entries)

    def __contains__(self, key: Any) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


def import_target(target: Any) -> Any:
    """Import a registered ``"module:Class"`` target (classes pass through)."""
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


def _singular(plural: str) -> str:
    return plural[:-3] + "y" if plural.endswith("ies") else plural[:-1]


def registered_subclass(
    registry: Registry, name: str, base: type, *, param: str, what: str, hook: str, doc: str,
    unprovided: dict[str, str] | None = None, listed: str | None = None, unprovided_label: str = "",
) -> type:
    """The class ``registry`` holds for ``name``, checked to subclass ``base``.

    A name nobody registered is a :class:`ConfigError` (``param``) listing the registered ones
    with their distributions and, for a FastDeploy name no package provides here
    (``unprovided``), why; a registered target that is not a ``base`` subclass names the plugin
    to fix. ``what`` names the kind ("scheduler"), ``hook`` and ``doc`` where a third party
    registers one; ``listed`` how the registered ones are called (default: ``what`` + "s"),
    ``unprovided_label`` a word after the FastDeploy name in the hint.
    """
    from fastdeploy_core.errors import ConfigError

    target = registry.get(name)
    if target is None:
        registered = ", ".join(f"{key} ({registry.entry(key).distribution})" for key in sorted(registry.keys()))
        why = (unprovided or {}).get(name)
        hint = (
            f"FastDeploy's {name!r}{' ' + unprovided_label if unprovided_label else ''}: {why}"
            if why
            else f"a third-party {_singular(listed) if listed else what} is a package registering it through {hook} ({doc}); "
            "install it, or pick a registered one"
        )
        raise ConfigError(
            f"{param}: no {what} {name!r} is registered; registered {listed or what + 's'}: "
            f"{registered or 'none'}; {hint}",
            param=param,
        )
    cls = import_target(target)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(
            f"{param}: {name!r} is registered as {target!r}, which is not a {base.__module__}.{base.__qualname__} "
            "subclass; fix the plugin that registers it",
            param=param,
        )
    return cls


class PluginManager:
    """The loaded plugins and their registries. Build it with :func:`load_plugins`."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginInfo] = []
        self.failed: list[FailedPlugin] = []
        self.devices: Registry[type] = Registry("device")
        self.models: Registry[Any] = Registry("model architecture")
        #: GGUF ``general.architecture`` -> (HF architecture, its GGUFArchitecture)
        self.gguf_architectures: Registry[tuple[str, hookspecs.GGUFArchitecture]] = Registry("GGUF architecture")
        self.quantizers: Registry[type] = Registry("quantization method")
        self.schedulers: Registry[type] = Registry("scheduler")
        #: speculative-decoding method name -> Proposer class or "module:Class"
        self.proposers: Registry[Any] = Registry("speculative decoding method")
        #: router policy name -> Policy class or "module:Class"
        self.router_policies: Registry[Any] = Registry("router policy")
        self.guided_backends: Registry[Any] = Registry("guided decoding backend")
        self.tool_parsers: Registry[Any] = Registry("tool call parser")
        self.reasoning_parsers: Registry[Any] = Registry("reasoning parser")
        self._info_by_name: dict[str, PluginInfo] = {}

    # ---- loading ---------------------------------------------------------------------------
    def add_plugin(self, module: Any, name: str, distribution: str, version: str) -> PluginInfo | None:
        """Check the module's contract version and register its hooks (once, in order)."""
        declared = getattr(module, "FD_PLUGIN_API_VERSION", None)
        if declared != PLUGIN_API_VERSION:
            err = PluginAPIVersionError(
                f"plugin {name!r} ({distribution} {version}) declares FD_PLUGIN_API_VERSION="
                f"{declared!r} but fastdeploy-core {__version__} speaks version {PLUGIN_API_VERSION}; "
                f"install a release of {distribution} built for plugin API {PLUGIN_API_VERSION}"
            )
            self._fail(name, distribution, version, err)
            return None
        info = PluginInfo(name, distribution, version, getattr(module, "__name__", str(module)))
        self.pm.register(module, name=name)
        self.plugins.append(info)
        self._info_by_name[name] = info
        return info

    def _fail(self, name: str, distribution: str, version: str, exc: BaseException) -> None:
        message = f"{type(exc).__name__}: {exc}"
        self.failed.append(FailedPlugin(name, distribution, version, message))
        warnings.warn(f"fastdeploy plugin {name!r} ({distribution}) is not loaded: {message}", stacklevel=3)

    def run_registration_hooks(self) -> None:
        """Call each plugin's registration hooks with a ``register`` bound to that plugin."""
        for hook_name in HOOK_NAMES:
            caller = getattr(self.pm.hook, hook_name)
            for impl in reversed(caller.get_hookimpls()):  # pluggy lists last-registered first
                info = self._info_by_name[impl.plugin_name]
                register = self._make_register(hook_name, info)
                impl.function(**{"register": register} if impl.argnames else {})

    def _make_register(self, hook_name: str, info: PluginInfo) -> Callable[..., None]:
        if hook_name == "register_devices":

            def register(device_cls: type) -> None:
                if not getattr(device_cls, "name", ""):
                    raise PluginError(f"plugin {info.name!r} registered a device class without a name")
                self.devices.add(device_cls.name, device_cls, info)
                info.registered[hook_name].append(device_cls.name)

        elif hook_name == "register_models":

            def register(
                architecture: str, target: Any, impl: str = "fastdeploy", gguf: hookspecs.GGUFArchitecture | None = None
            ) -> None:
                if impl not in ("fastdeploy", "paddleformers"):
                    raise PluginError(f"plugin {info.name!r}: impl must be 'fastdeploy' or 'paddleformers', got {impl!r}")
                if gguf is not None and not isinstance(gguf, hookspecs.GGUFArchitecture):
                    raise PluginError(
                        f"plugin {info.name!r}: gguf= takes a fastdeploy_core.hookspecs.GGUFArchitecture, "
                        f"got {type(gguf).__name__}"
                    )
                if gguf is not None and architecture == "*":
                    raise PluginError(
                        f"plugin {info.name!r}: a GGUF architecture needs the HF architecture it loads as, not '*'"
                    )
                self.models.add((architecture, impl), target, info)
                info.registered[hook_name].append(f"{architecture} ({impl})")
                if gguf is not None:
                    self.gguf_architectures.add(gguf.name, (architecture, gguf), info)
                    info.gguf_architectures.append(f"{gguf.name} -> {architecture}")

        else:
            registry = {
                "register_quantizers": self.quantizers,
                "register_schedulers": self.schedulers,
                "register_proposers": self.proposers,
                "register_router_policies": self.router_policies,
                "register_guided_backends": self.guided_backends,
                "register_tool_parsers": self.tool_parsers,
                "register_reasoning_parsers": self.reasoning_parsers,
            }[hook_name]

            def register(name: str, cls: type) -> None:
                registry.add(name, cls, info)
                info.registered[hook_name].append(name)

        return register

    def register_commands(self, app: Any) -> None:
        """Let every plugin add its typer sub-commands."""
        self.pm.hook.register_commands(app=app)

    # ---- questions ---------------------------------------------------------------------------
    def failure_for_distribution(self, distribution: str) -> FailedPlugin | None:
        norm = distribution.replace("_", "-").lower()
        for failed in self.failed:
            if failed.distribution.replace("_", "-").lower() == norm:
                return failed
        return None

    def select_device(self, name: str = "auto") -> type:
        """The Device class for ``--device NAME`` (``auto``: the available one of highest priority)."""
        if name == "auto":
            candidates = sorted(
                (self.devices.get(k) for k in self.devices.keys()), key=lambda d: -d.priority  # type: ignore[union-attr]
            )
            for device_cls in candidates:
                try:
                    if device_cls.detect().available:
                        return device_cls
                except Exception as exc:  # a broken detector must not stop auto-selection
                    logger.warning("device %s detection raised %s; skipping it", device_cls.name, exc)
            raise DeviceUnavailableError("no device is available, not even cpu: is the builtin plugin disabled?")
        device_cls = self.devices.get(name)
        if device_cls is None:
            package = KNOWN_DEVICE_PACKAGES.get(name)
            failed = self.failure_for_distribution(package) if package else None
            if failed is not None:
                raise DeviceUnavailableError(
                    f"device {name!r} is provided by {package}, which is installed but failed to load: {failed.error}"
                )
            known = ", ".join(sorted(set(self.devices.keys()) | {"auto"}))
            hint = f"install the plugin package `{package}`" if package else "no known package provides it"
            raise DeviceUnavailableError(f"no installed plugin provides device {name!r}: {hint} (registered devices: {known})")
        avail = device_cls.detect()
        if not avail.available:
            raise DeviceUnavailableError(f"device {name!r} is installed but not usable here: {avail.reason}")
        return device_cls

    def gguf_architecture(self, name: str, path: str) -> tuple[str, hookspecs.GGUFArchitecture]:
        """``(hf_architecture, GGUFArchitecture)`` registered for GGUF ``general.architecture`` ``name``.

        UnsupportedArchitectureError (a ModelLoadError) when no plugin registered it, listing the
        registered ones and naming the plugin to install.
        """
        found = self.gguf_architectures.get(name)
        if found is not None:
            return found
        listing = ", ".join(
            f"{key} ({self.gguf_architectures.entry(key).distribution})"  # type: ignore[union-attr]
            for key in sorted(self.gguf_architectures.keys())
        )
        package = KNOWN_GGUF_PACKAGES.get(name)
        failed = self.failure_for_distribution(package) if package else None
        if failed is not None:
            hint = f"it is registered by {package}, which is installed but failed to load: {failed.error}"
        elif package:
            hint = f"install the model plugin `{package}` (or allow it in {ALLOW_LIST_ENV}), which registers it"
        else:
            hint = (
                "no known plugin registers it: install a model plugin that registers this GGUF architecture "
                "(register_models with gguf=..., see docs/writing-a-plugin.md) or convert the model to an HF "
                "safetensors directory"
            )
        raise UnsupportedArchitectureError(
            f"GGUF architecture {name!r} of {path} is not supported; supported GGUF architectures: "
            f"{listing or 'none registered'}; {hint}"
        )

    def native_architectures(self) -> list[str]:
        return sorted(a for a, impl in self.models.keys() if impl == "fastdeploy" and a != "*")

    def model_provider(self, architecture: str, impl: str = "auto", hf_config: dict | None = None) -> tuple[Any, str, str]:
        """(target, impl used, why) for ``architecture`` under ``--model-impl impl``.

        The native target is not imported. With ``hf_config``, a fallback about to be chosen is
        imported and asked ``supports(hf_config) -> (ok, reason)`` (if it has that classmethod),
        so an architecture it cannot build fails here with its reason.
        """
        native = self.models.get((architecture, "fastdeploy"))
        fallback = self.models.get((architecture, "paddleformers")) or self.models.get(("*", "paddleformers"))
        if impl == "fastdeploy":
            if native is None:
                raise UnsupportedArchitectureError(
                    f"--model-impl fastdeploy: no native implementation of {architecture!r}; native "
                    f"architectures: {', '.join(self.native_architectures()) or 'none installed'} "
                    "(use --model-impl auto or paddleformers to try the PaddleFormers fallback)"
                )
            return native, "fastdeploy", "native implementation requested"
        if impl == "paddleformers":
            if fallback is None:
                raise UnsupportedArchitectureError(
                    f"--model-impl paddleformers: the PaddleFormers fallback is not installed or failed to load "
                    f"({self._fallback_status()}); install fd-paddleformers"
                )
            detail = self._check_fallback(fallback, architecture, impl, hf_config)
            return fallback, "paddleformers", f"PaddleFormers fallback requested{detail}"
        if native is not None:
            return native, "fastdeploy", f"native implementation of {architecture}"
        if fallback is not None:
            detail = self._check_fallback(fallback, architecture, impl, hf_config)
            return fallback, "paddleformers", f"no native implementation of {architecture}; using the PaddleFormers fallback{detail}"
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported: native architectures are "
            f"{', '.join(self.native_architectures()) or 'none installed'}; the PaddleFormers fallback "
            f"{self._fallback_status()}"
        )

    def _check_fallback(self, target: Any, architecture: str, impl: str, hf_config: dict | None) -> str:
        """`` (reason)`` from the fallback's ``supports``; raises when it cannot serve ``hf_config``."""
        supports = getattr(import_target(target), "supports", None) if hf_config is not None else None
        if supports is None:
            return ""
        ok, reason = supports(hf_config)
        if not ok:
            raise UnsupportedArchitectureError(
                f"--model-impl {impl}: the PaddleFormers fallback cannot serve {architecture}: {reason}; native "
                f"architectures: {', '.join(self.native_architectures()) or 'none installed'}"
            )
        return f" ({reason})"

    def _fallback_status(self) -> str:
        failed = self.failure_for_distribution("fd-paddleformers")
        if failed:
            return f"failed to load: {failed.error}"
        if ("*", "paddleformers") in self.models:
            return "is installed"
        return "is not installed (pip install fd-paddleformers)"

    def resolve_model(self, architecture: str, impl: str = "auto", hf_config: dict | None = None) -> type:
        """The model class for ``architecture`` (imported now); see :meth:`model_provider`."""
        target, _, _ = self.model_provider(architecture, impl, hf_config)
        return import_target(target)

    def describe(self) -> list[dict]:
        """Every plugin with what it registered, then every failed one, for ``fastdeploy plugins``."""
        out: list[dict] = [
            {
                "name": p.name,
                "distribution": p.distribution,
                "version": p.version,
                "module": p.module,
                "status": "loaded",
                "registered": {h.removeprefix("register_"): list(v) for h, v in p.registered.items()},
                "gguf_architectures": list(p.gguf_architectures),
            }
            for p in self.plugins
        ]
        out += [
            {"name": f.name, "distribution": f.distribution, "version": f.version, "status": "failed", "error": f.error}
            for f in self.failed
        ]
        return out


def _allow_list() -> set[str] | None:
    raw = os.environ.get(ALLOW_LIST_ENV)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


#: The hook module of the core's own plugin (the cpu device, the built-in quantizers, core commands).
BUILTIN_PLUGIN_MODULE = "fastdeploy_core.builtin.plugin"


def load_plugins() -> PluginManager:
    """Discover, load and register every allowed plugin (a fresh manager each call)."""
    from importlib import metadata

    manager = PluginManager()
    # The core's own plugin is loaded by module name, as an entry point is: the plugin machinery
    # sits below everything a plugin provides and imports none of it.
    manager.add_plugin(importlib.import_module(BUILTIN_PLUGIN_MODULE), "builtin", CORE_DISTRIBUTION, __version__)
    allowed = _allow_list()
    seen: set[str] = set()
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in seen or (allowed is not None and ep.name not in allowed):
            continue
        seen.add(ep.name)
        dist = ep.dist.name if ep.dist is not None else "unknown"
        version = ep.dist.version if ep.dist is not None else "unknown"
        try:
            module = ep.load()
        except Exception as exc:  # isolate the broken plugin; the rest keep working
            manager._fail(ep.name, dist, version, exc)
            continue
        manager.add_plugin(module, ep.name, dist, version)
    manager.run_registration_hooks()
    return manager


_cached: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide manager, loaded on first use."""
    global _cached
    if _cached is None:
        _cached = load_plugins()
    return _cached
