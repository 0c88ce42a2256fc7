"""Process settings the cpu device needs before Paddle loads: the one place that sets them.

Paddle pins ``OMP_NUM_THREADS`` to 1 on import when it is unset (every MKL GEMM then runs on
one core), and MKL reads ``MKL_DEBUG_CPU_TYPE`` when Paddle loads it, so both must be in the
environment before anything imports Paddle; :mod:`fastdeploy_core` calls
:func:`configure_process_env` on import for that reason. A value the user set is never changed.

It also maps the kernels' former variable names (``FD_DISABLE_QUANT_KERNELS``,
``FD_QUANT_KERNEL_THREADS``, ``FD_QUANT_KERNEL_SPIN``) to the current ones with a deprecation
warning; the C++ thread pool reads only the current names.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import MutableMapping

#: ``FD_CPU_KERNELS=0`` runs the plain-Paddle reference ops instead of the C++ kernels.
KERNELS_ENV = "FD_CPU_KERNELS"
#: Threads of the kernels' pool (default: ``OMP_NUM_THREADS``, else every usable core).
KERNEL_THREADS_ENV = "FD_CPU_KERNEL_THREADS"
#: Microseconds a pool worker spins for more work before it sleeps.
KERNEL_SPIN_ENV = "FD_CPU_KERNEL_SPIN"

#: Former name -> (current name, how a former value translates).
_DEPRECATED = {
    "FD_DISABLE_QUANT_KERNELS": (KERNELS_ENV, lambda value: "0" if value not in ("", "0") else "1"),
    "FD_QUANT_KERNEL_THREADS": (KERNEL_THREADS_ENV, lambda value: value),
    "FD_QUANT_KERNEL_SPIN": (KERNEL_SPIN_ENV, lambda value: value),
}


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), else the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def is_amd_cpu() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            return any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in fh)
    except OSError:
        return False


def configure_process_env(environ: MutableMapping[str, str] | None = None) -> None:
    """Fill in the cpu device's process settings that the user left unset."""
    environ = os.environ if environ is None else environ
    environ.setdefault("OMP_NUM_THREADS", str(usable_cores()))
    if is_amd_cpu():
        # Paddle's MKL (mklml) takes a generic sgemm on AMD CPUs; type 5 selects its AVX2
        # kernels, 2-3x faster float32 GEMMs on the EPYC machines this was measured on.
        environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
    for old, (new, translate) in _DEPRECATED.items():
        if old in environ:
            warnings.warn(f"{old} is deprecated; set {new} instead", FutureWarning, stacklevel=2)
            environ.setdefault(new, translate(environ[old]))


def kernels_disabled(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether ``FD_CPU_KERNELS=0`` (or the former ``FD_DISABLE_QUANT_KERNELS=1``) is set."""
    environ = os.environ if environ is None else environ
    value = environ.get(KERNELS_ENV)
    if value is None and "FD_DISABLE_QUANT_KERNELS" in environ:
        value = _DEPRECATED["FD_DISABLE_QUANT_KERNELS"][1](environ["FD_DISABLE_QUANT_KERNELS"])
    return value is not None and value.strip().lower() in ("0", "false", "no", "off")
