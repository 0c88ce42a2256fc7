"""The Device contract: a capability object the core asks instead of branching on names.

A chip plugin subclasses :class:`Device`, fills the class attributes, implements
:meth:`detect`, and (optionally) provides an ``ops_class`` deriving from
:class:`~fastdeploy_core.devices.reference_ops.ReferenceOps` that overrides the ops the chip
has fused kernels for. Everything else is inherited from the plain-Paddle reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

#: Paddle's place string for host memory (``paddle.CPUPlace``): the one place that takes no
#: device index, and where the conformance kit runs any ops table's host-side code paths.
HOST_PLACE = "cpu"

#: Environment variable that picks the attention backend when ``--attention-backend`` is not given.
ATTENTION_BACKEND_ENV = "FD_ATTENTION_BACKEND"


@dataclass(frozen=True)
class Availability:
    """Result of :meth:`Device.detect`: usable or not, and why not."""

    available: bool
    reason: str = ""

    @classmethod
    def yes(cls) -> "Availability":
        return cls(True, "")

    @classmethod
    def no(cls, reason: str) -> "Availability":
        return cls(False, reason)


@dataclass(frozen=True)
class MemoryInfo:
    """Bytes of device memory: total and currently free for this process to use."""

    total_bytes: int
    free_bytes: int


class Device:
    """Base class of every device. Subclasses are registered through ``register_devices``.

    Class attributes are the declaration; methods answer questions that need the machine.
    """

    #: Name used on the command line (``--device NAME``), e.g. ``"cpu"``, ``"gpu"``, ``"xpu"``.
    name: ClassVar[str] = ""
    #: Paddle's device type string passed to ``paddle.set_device`` (``"cpu"``, ``"gpu"``,
    #: ``"xpu"``, or a custom device type such as ``"iluvatar_gpu"``).
    paddle_device_type: ClassVar[str] = ""
    #: Higher wins for ``--device auto``; the built-in cpu device is 0.
    priority: ClassVar[int] = 0
    #: Paddle dtypes this device computes in, first is the default.
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    #: Collective backend, as ``paddle.distributed`` names it (gloo, nccl, bkcl, xccl).
    dist_backend: ClassVar[str] = "gloo"
    #: Environment Paddle's collective layer needs for this device, e.g. custom devices set
    #: ``PADDLE_XCCL_BACKEND`` to their device type so ``xccl`` loads the vendor's library.
    dist_env: ClassVar[dict[str, str]] = {}
    #: Whether the decode step can be captured as a graph on this device.
    supports_graph_capture: ClassVar[bool] = False
    #: Quantization method names (registry names) this device runs.
    quantization_methods: ClassVar[tuple[str, ...]] = ()
    #: Attention backend names this device offers; the first is the default.
    attention_backends: ClassVar[tuple[str, ...]] = ("paged_reference",)
    #: Pip package that provides this device (for error messages); "" for built-ins.
    package: ClassVar[str] = ""
    #: The ops table class. ``None`` means the plain-Paddle reference ops.
    ops_class: ClassVar[type | None] = None

    # ---- questions that need the machine -------------------------------------------------
    @classmethod
    def detect(cls) -> Availability:
        """Whether this device can be used here; if not, a reason a user can act on."""
        raise NotImplementedError(f"{cls.__name__}.detect must be implemented by the plugin")

    @classmethod
    def device_count(cls) -> int:
        """Number of visible devices of this type (0 when unavailable)."""
        return 1 if cls.detect().available else 0

    @classmethod
    def memory_info(cls, index: int = 0) -> MemoryInfo:
        """Total and free memory of device ``index``."""
        raise NotImplementedError(f"{cls.__name__}.memory_info must be implemented by the plugin")

    @classmethod
    def paddle_place(cls, index: int = 0) -> str:
        """The string for ``paddle.set_device``, e.g. ``"gpu:0"`` or ``"cpu"``."""
        return HOST_PLACE if cls.paddle_device_type == HOST_PLACE else f"{cls.paddle_device_type}:{index}"

    @classmethod
    def zeros(cls, shape: tuple[int, ...] | list[int], dtype: str):
        """A zero-filled tensor on this device for a long-lived buffer (the paged KV cache)."""
        import paddle

        return paddle.zeros(list(shape), dtype=dtype)

    @classmethod
    def make_ops(cls, attention_backend: str | None = None):
        """Build this device's ops table, with the chosen attention backend."""
        from fastdeploy_core.devices.reference_ops import ReferenceOps

        backend = cls.select_attention_backend(attention_backend)
        ops_cls = cls.ops_class or ReferenceOps
        return ops_cls(attention_backend=backend)

    @classmethod
    def select_attention_backend(cls, requested: str | None) -> str:
        """Pick ``requested``, else env ``FD_ATTENTION_BACKEND``, else the default (the first).

        Names are matched case-insensitively; an unknown name is a :class:`ConfigError`
        listing the backends this device offers.
        """
        from fastdeploy_core.errors import ConfigError

        source = "--attention-backend"
        if not requested:
            requested = os.environ.get(ATTENTION_BACKEND_ENV, "").strip() or None
            source = ATTENTION_BACKEND_ENV
        if not requested:
            return cls.attention_backends[0]
        wanted = requested.strip().lower()
        for backend in cls.attention_backends:
            if backend.lower() == wanted:
                return backend
        raise ConfigError(
            f"attention backend {requested!r} (from {source}) is not offered by device {cls.name!r}; "
            f"available: {', '.join(cls.attention_backends)}",
            param="attention_backend",
        )

    @classmethod
    def describe(cls) -> dict:
        """Everything the device declares, for ``fastdeploy env`` and ``fastdeploy plugins``."""
        try:
            avail = cls.detect()
        except Exception as exc:  # detection must never take the CLI down
            avail = Availability.no(f"detection raised {type(exc).__name__}: {exc}")
        try:
            count = cls.device_count() if avail.available else 0
        except Exception as exc:  # same rule: report, never crash
            count = 0
            avail = Availability.no(f"device_count raised {type(exc).__name__}: {exc}")
        ops_cls = cls.ops_class
        return {
            "name": cls.name,
            "paddle_device_type": cls.paddle_device_type,
            "available": avail.available,
            "reason": avail.reason,
            "device_count": count,
            "priority": cls.priority,
            "supported_dtypes": list(cls.supported_dtypes),
            "dist_backend": cls.dist_backend,
            "dist_env": dict(cls.dist_env),
            "supports_graph_capture": cls.supports_graph_capture,
            "quantization_methods": list(cls.quantization_methods),
            "attention_backends": list(cls.attention_backends),
            "package": cls.package,
            "ops_class": f"{ops_cls.__module__}.{ops_cls.__qualname__}" if ops_cls else "reference",
        }
