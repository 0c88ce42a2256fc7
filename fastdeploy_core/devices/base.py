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


#: FastDeploy's default ``--gpu-memory-utilization``: the share of a device's own memory the engine
#: may fill, used when the device keeps memory of its own and the user gave no share.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

_MiB = 1 << 20


@dataclass(frozen=True)
class KVBudget:
    """What :meth:`Device.default_kv_budget` chose: ``bytes`` for the KV cache and ``rule``, one
    sentence naming the rule and its numbers (the engine logs it beside the block count)."""

    bytes: int
    rule: str


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
    #: Whether the device computes in the host's RAM (the cpu; integrated chips that share it).
    #: Memory there is everyone's: the default KV budget is then a modest share of what is
    #: available (see :meth:`default_kv_budget`), not FastDeploy's 90% of a card of its own.
    memory_shared_with_host: ClassVar[bool] = False
    #: On a device that shares the host's memory: the share of available memory the default KV
    #: budget may take.
    host_kv_share: ClassVar[float] = 0.25
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
    #: KV transports between prefill and decode instances, by ``--cache-transfer-protocol`` name:
    #: :class:`~fastdeploy_core.devices.kv_transport.KVTransport` subclasses (docs/disaggregation.md).
    kv_transports: ClassVar[dict[str, type]] = {}

    # ---- questions that need the machine -------------------------------------------------
    @classmethod
    def detect(cls) -> Availability:
        """Whether this device can be used here; if not, a reason a user can act on."""
        raise NotImplementedError(f"{cls.__name__}.detect must be implemented by the plugin")

    @classmethod
    def rank_environment(cls, rank: int, world_size: int) -> dict[str, str]:
        """Environment of the process running tensor-parallel rank ``rank`` of ``world_size``
        (set before it imports Paddle): :attr:`dist_env`, and the card the rank computes on
        (``FLAGS_selected_<type>s``, which Paddle's collective layer reads). Devices that share
        one chip between ranks (the cpu's cores) override it. Only the cpu's has run here."""
        return {**cls.dist_env, f"FLAGS_selected_{cls.paddle_device_type}s": str(rank)}

    @classmethod
    def tp_collectives(cls, rank: int, world_size: int, session: str):
        """The collectives tensor-parallel ranks on this device use, built on every rank (it
        meets the other ranks; ``session`` is a token unique to this launch). Here:
        ``paddle.distributed`` initialised on :attr:`dist_backend` from the rendezvous variables
        the launcher set (Paddle's rendezvous store listens on every interface while the ranks
        live); the cpu device's ranks meet in shared memory instead, with no socket
        (:mod:`fastdeploy_core.devices.collectives` has the contract)."""
        import paddle.distributed

        from fastdeploy_core.devices.collectives import PaddleCollectives

        paddle.distributed.init_parallel_env()
        return PaddleCollectives()

    @classmethod
    def device_count(cls) -> int:
        """Number of visible devices of this type (0 when unavailable)."""
        return 1 if cls.detect().available else 0

    @classmethod
    def memory_info(cls, index: int = 0) -> MemoryInfo:
        """Total and free memory of device ``index``."""
        raise NotImplementedError(f"{cls.__name__}.memory_info must be implemented by the plugin")

    @classmethod
    def default_kv_budget(
        cls,
        *,
        free_bytes: int,
        activation_bytes: int,
        sequence_bytes: int,
        max_num_seqs: int,
        gpu_memory_utilization: float | None = None,
    ) -> KVBudget:
        """The KV cache bytes to allocate when the user gave no exact size.

        ``free_bytes`` is the device memory free after the weights loaded, ``activation_bytes``
        the estimate of one step's temporaries, ``sequence_bytes`` what one ``max_model_len``
        sequence's KV needs. Never more than ``max_num_seqs`` such sequences: the scheduler
        cannot run more at once, so blocks beyond that would only hold prefix cache.

        * Memory of its own (GPU-like; FastDeploy's rule): ``gpu_memory_utilization`` (default
          0.9) of the free memory, minus the activations. Nothing else lives on the card.
        * Memory shared with the host, no ``gpu_memory_utilization`` given: ``host_kv_share``
          (25%) of the available RAM, and never less than one ``max_model_len`` sequence when
          RAM has room for it. RAM is shared with the OS, the page cache, the API server and
          whatever else runs; a quarter leaves three quarters to them, and on a 24 GB host
          running a 135M model it still holds ~14 full 8k-token sequences (the 90% rule took 19
          GB that the process's RSS then grew into under load). Asking for more is one flag
          (``--kv-cache-memory``, or ``--gpu-memory-utilization`` for the share rule above).

        A budget below one sequence is returned as is: the caller refuses it with the numbers.
        """
        wanted = sequence_bytes * max_num_seqs
        wanted_text = f"{max_num_seqs} sequences of max_model_len need {wanted / _MiB:.0f} MiB"
        if cls.memory_shared_with_host and gpu_memory_utilization is None:
            share = int(free_bytes * cls.host_kv_share)
            budget = min(wanted, share)
            rule = (
                f"{cls.name} memory is the host's: the smaller of {cls.host_kv_share:.0%} of "
                f"{free_bytes / _MiB:.0f} MiB available after the weights ({share / _MiB:.0f} MiB) and what "
                f"{wanted_text}"
            )
            if budget < sequence_bytes <= free_bytes - activation_bytes:
                budget = sequence_bytes
                rule += f", raised to one max_model_len sequence ({sequence_bytes / _MiB:.0f} MiB)"
            return KVBudget(budget, rule + "; set --kv-cache-memory for an exact size")
        utilization = DEFAULT_GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
        room = max(0, int(free_bytes * utilization) - activation_bytes)
        return KVBudget(
            min(wanted, room),
            f"--gpu-memory-utilization {utilization} of {free_bytes / _MiB:.0f} MiB free {cls.name} memory after "
            f"the weights, minus {activation_bytes / _MiB:.0f} MiB for activations ({room / _MiB:.0f} MiB), at most "
            f"what {wanted_text}",
        )

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
    def make_kv_transport(cls, name: str):
        """The transport ``name`` of :attr:`kv_transports`; a ConfigError naming those offered."""
        from fastdeploy_core.errors import ConfigError

        if name not in cls.kv_transports:
            offered = ", ".join(cls.kv_transports) or "none"
            raise ConfigError(
                f"cache_transfer_protocol: {name!r} is not a KV transport of device {cls.name!r} (it offers: {offered})",
                param="cache_transfer_protocol",
            )
        return cls.kv_transports[name]()

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
            "memory_shared_with_host": cls.memory_shared_with_host,
            "supports_graph_capture": cls.supports_graph_capture,
            "quantization_methods": list(cls.quantization_methods),
            "attention_backends": list(cls.attention_backends),
            "package": cls.package,
            "kv_transports": list(cls.kv_transports),
            "ops_class": f"{ops_cls.__module__}.{ops_cls.__qualname__}" if ops_cls else "reference",
        }
