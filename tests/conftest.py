"""Shared test set-up: thread count before Paddle is imported anywhere, offline model hubs."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# ``restore_ops`` (put the process-wide ops table back) comes from the pytest plugin the core
# installs (fastdeploy_core/testing/pytest_plugin.py), so plugins' own tests have it too.

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def cpu_kernels():
    """The cpu device's built kernel module; the test fails when it cannot build here (the first
    run on a machine builds it: ~30 s)."""
    from fastdeploy_core.builtin.cpu.kernels import kernel_failure, load_kernels

    module = load_kernels()
    assert module is not None, f"the cpu kernels must build on this machine: {kernel_failure()}"
    return module
