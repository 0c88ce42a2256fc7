"""The built-in cpu device: always available, lowest priority, every op in plain Paddle."""

from __future__ import annotations

import os

from fastdeploy_core.devices.base import Availability, Device, MemoryInfo
from fastdeploy_core.builtin.cpu.kv_transport import ShmKVTransport, TcpKVTransport
from fastdeploy_core.builtin.cpu.ops import CpuOps


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class CpuDevice(Device):
    """Host CPU through Paddle's CPU kernels; the reference every other device is checked against."""

    name = "cpu"
    paddle_device_type = "cpu"
    priority = 0
    # float32 throughout; bfloat16 for the linear layers only (--dtype bfloat16: CpuOps.bf16_linear,
    # fd_bf16_linear with vdpbf16ps on AVX-512 BF16 CPUs, the same sums widened to float32 elsewhere).
    supported_dtypes = ("float32", "bfloat16")
    dist_backend = "gloo"
    memory_shared_with_host = True  # the KV cache is RAM the OS and every other process need too
    supports_graph_capture = True  # CpuOps.capture_graph records the C++ kernels (refused without them)
    attention_backends = ("paged_reference",)
    # Each runs through a C++ kernel reading the compact weights (reference path if it cannot build).
    quantization_methods = ("wint8", "wint4", "w8a8", "w4a8", "block_wise_fp8", "mix_quant")
    ops_class = CpuOps  # the reference ops plus the quantized linear kernels
    # Prefill/decode KV transports: shm (same host, no socket copy of the bytes) and tcp.
    kv_transports = {"shm": ShmKVTransport, "tcp": TcpKVTransport}

    @classmethod
    def detect(cls) -> Availability:
        return Availability.yes()

    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def tp_collectives(cls, rank: int, world_size: int, session: str):
        """Ranks on one host meet in shared memory (gloo costs ~2 ms per all-reduce here)."""
        from fastdeploy_core.builtin.cpu.shm_collectives import SharedMemoryCollectives

        return SharedMemoryCollectives(rank, world_size, session)

    @classmethod
    def rank_environment(cls, rank: int, world_size: int) -> dict[str, str]:
        """Tensor-parallel ranks share the cores: each gets ``FD_CPU_THREADS_PER_RANK`` threads
        (default: the usable cores divided by the ranks, at least one) for Paddle's OpenMP and
        the C++ kernels' pool."""
        from fastdeploy_core.builtin.cpu.process_env import KERNEL_THREADS_ENV, threads_per_rank

        threads = str(threads_per_rank(world_size))
        return {**cls.dist_env, "OMP_NUM_THREADS": threads, KERNEL_THREADS_ENV: threads}

    @classmethod
    def memory_info(cls, index: int = 0) -> MemoryInfo:
        total = _meminfo_bytes("MemTotal")
        free = _meminfo_bytes("MemAvailable")
        if total is None or free is None:
            pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
            avail = os.sysconf("SC_AVPHYS_PAGES")
            total, free = pages * page_size, avail * page_size
        return MemoryInfo(total_bytes=total, free_bytes=free)

    @classmethod
    def zeros(cls, shape: tuple[int, ...] | list[int], dtype: str):
        """numpy's calloc-backed zeros shared with Paddle through DLPack: no copy, and the OS
        commits pages only when they are first written, so a large KV budget costs RAM as it fills.
        (The DLPack capsule keeps the numpy buffer alive as long as the tensor.)"""
        import numpy as np
        import paddle

        if str(dtype) == "bfloat16":  # numpy has no bfloat16: its bits as int16, viewed as bfloat16 (no copy)
            return paddle.utils.dlpack.from_dlpack(np.zeros(tuple(shape), dtype=np.int16)).view(paddle.bfloat16)
        return paddle.utils.dlpack.from_dlpack(np.zeros(tuple(shape), dtype=dtype))
