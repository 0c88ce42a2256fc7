"""What the host CPU can execute, read once from ``/proc/cpuinfo``.

Paddle's CPU build carries kernels compiled for AVX-512 that it runs without asking the CPU:
``fused_rms_norm`` (its ``RmsNormAvxKernel`` stores ``zmm`` registers) dies with SIGILL on an
AVX2-only CPU such as an AMD EPYC 7002 (Zen 2). ``devices.kernels.has_kernel`` (what the fused
ops ask) and the reference ops ask :func:`paddle_cpu_kernel_safe` before running such a kernel.
"""

from __future__ import annotations

import functools
import platform


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``avx2``, ``avx512f``, ``amx_bf16``, ...)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset(platform.processor().split())


def has_avx512f() -> bool:
    """Whether the CPU executes AVX-512 Foundation instructions."""
    return "avx512f" in cpu_flags()


def has_avx2_fma() -> bool:
    """Whether the CPU executes AVX2 and FMA3 instructions (256-bit vectors with multiply-add)."""
    flags = cpu_flags()
    return "avx2" in flags and "fma" in flags


#: Paddle's CPU kernels built for AVX-512 only (by the name its kernel registry knows them).
PADDLE_AVX512_ONLY_CPU_KERNELS = frozenset({"fused_rms_norm_quant"})


def paddle_cpu_kernel_safe(tensor) -> bool:
    """Whether Paddle's AVX-512-only CPU kernels may run for ``tensor``: it is not on the CPU, or
    the CPU has AVX-512."""
    return not tensor.place.is_cpu_place() or has_avx512f()
