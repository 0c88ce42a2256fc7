"""Process settings the cpu device needs before Paddle loads: the one place that sets them.

Paddle pins ``OMP_NUM_THREADS`` to 1 on import when it is unset (every MKL GEMM then runs on
one core), and MKL reads ``MKL_DEBUG_CPU_TYPE`` when Paddle loads it, so both must be in the
environment before anything imports Paddle; :mod:`fastdeploy_core` calls
:func:`configure_process_env` on import for that reason. A value the user set is never changed.

Paddle also prints "WARNING: OMP_NUM_THREADS set to N, not 1 ... PLEASE USE OMP_NUM_THREADS
WISELY" on import whenever the variable is above 1 (``paddle.base.__bootstrap__`` reads it with
``os.getenv`` and writes it back). That warning is about data-parallel training and OpenBLAS
builds, neither of which applies here, and it would follow every command because this module
sets the variable. :func:`quiet_paddle_thread_warning` lets Paddle's bootstrap see 1 while it
imports and then puts the thread count back, in the environment (the kernels' thread pool and
the OpenMP runtime read it when they start, after the import) and in Paddle's MKL/OpenMP setting.

It also maps the kernels' former variable names (``FD_DISABLE_QUANT_KERNELS``,
``FD_QUANT_KERNEL_THREADS``, ``FD_QUANT_KERNEL_SPIN``) to the current ones with a deprecation
warning; the C++ thread pool reads only the current names.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
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


#: Threads of each tensor-parallel rank on the cpu (default: the usable cores split between the ranks).
THREADS_PER_RANK_ENV = "FD_CPU_THREADS_PER_RANK"


def threads_per_rank(world_size: int, environ: MutableMapping[str, str] | None = None) -> int:
    """``FD_CPU_THREADS_PER_RANK`` if set (a positive integer), else ``usable_cores() // world_size``, at least 1."""
    environ = os.environ if environ is None else environ
    given = environ.get(THREADS_PER_RANK_ENV, "").strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ValueError(f"{THREADS_PER_RANK_ENV}={given!r}: give a positive number of threads")
        return int(given)
    return max(1, usable_cores() // world_size)


def is_amd_cpu() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            return any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in fh)
    except OSError:
        return False


def configure_process_env(environ: MutableMapping[str, str] | None = None) -> None:
    """Fill in the cpu device's process settings that the user left unset."""
    if environ is None:
        environ = os.environ
        quiet_paddle_thread_warning()
    environ.setdefault("OMP_NUM_THREADS", str(usable_cores()))
    if is_amd_cpu():
        # Paddle's MKL (mklml) takes a generic sgemm on AMD CPUs; type 5 selects its AVX2
        # kernels, 2-3x faster float32 GEMMs on the EPYC machines this was measured on.
        environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
    for old, (new, translate) in _DEPRECATED.items():
        if old in environ:
            warnings.warn(f"{old} is deprecated; set {new} instead", FutureWarning, stacklevel=2)
            environ.setdefault(new, translate(environ[old]))


class _PaddleImportFinder(importlib.abc.MetaPathFinder):
    """Finds ``paddle`` the ordinary way, once, and hands it a loader that imports it quietly."""

    def __init__(self) -> None:
        self.done = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "paddle" or self.done:
            return None
        self.done = True  # stays in sys.meta_path (removing it would skip the next finder) but idle
        spec = importlib.util.find_spec("paddle")
        if spec is None or spec.loader is None:
            return None
        spec.loader = _QuietBootstrapLoader(spec.loader)
        return spec


class _QuietBootstrapLoader(importlib.abc.Loader):
    """Runs Paddle's own loader with ``OMP_NUM_THREADS=1``, then restores the thread count."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        # Paddle sees its own loader, as after any import.
        module.__loader__ = self.loader
        module.__spec__.loader = self.loader
        threads = os.environ.get("OMP_NUM_THREADS", "")
        pinned = threads.isdigit() and int(threads) > 1
        if pinned:
            os.environ["OMP_NUM_THREADS"] = "1"
        try:
            with warnings.catch_warnings():
                # Its import also warns that ccache is missing (it only speeds up rebuilding C++
                # extensions); a filter set earlier may be gone by then (pytest resets them).
                warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
                self.loader.exec_module(module)
        finally:
            if pinned:
                os.environ["OMP_NUM_THREADS"] = threads
        # The OpenMP runtime reads the variable lazily, but set MKL's and OpenMP's count as well
        # in case anything in the import already started it.
        core = getattr(getattr(module, "base", None), "core", None)
        if pinned and hasattr(core, "set_num_threads"):
            core.set_num_threads(int(threads))


def quiet_paddle_thread_warning() -> None:
    """Make the first ``import paddle`` in this process skip its ``OMP_NUM_THREADS`` warning
    without losing the thread count (see the module docstring). No-op once Paddle is imported."""
    if "paddle" in sys.modules or any(isinstance(f, _PaddleImportFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _PaddleImportFinder())


def kernels_forced(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether ``FD_CPU_KERNELS=1`` asks for the kernels even on a CPU they are not chosen for (no AVX-512)."""
    value = (os.environ if environ is None else environ).get(KERNELS_ENV)
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")


def kernels_disabled(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether ``FD_CPU_KERNELS=0`` (or the former ``FD_DISABLE_QUANT_KERNELS=1``) is set."""
    environ = os.environ if environ is None else environ
    value = environ.get(KERNELS_ENV)
    if value is None and "FD_DISABLE_QUANT_KERNELS" in environ:
        value = _DEPRECATED["FD_DISABLE_QUANT_KERNELS"][1](environ["FD_DISABLE_QUANT_KERNELS"])
    return value is not None and value.strip().lower() in ("0", "false", "no", "off")
