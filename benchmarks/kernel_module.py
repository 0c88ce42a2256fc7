"""The cpu device's built kernel module for the kernel benchmarks (two threads unless
``OMP_NUM_THREADS`` says otherwise), or an exit saying why it is missing."""

from __future__ import annotations

import os


def kernels_or_exit():
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    from fastdeploy_core.builtin.cpu.kernels import kernel_failure, load_kernels

    kernels = load_kernels()
    if kernels is None:
        raise SystemExit(f"the cpu kernels did not build on this machine: {kernel_failure()}")
    return kernels
