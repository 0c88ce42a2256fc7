"""Fixtures of the quantization tests: the cpu kernels, and the ops table put back after each test."""

from __future__ import annotations

import pytest

from fastdeploy_core.devices.current import current_ops, set_current_ops
from fastdeploy_core.quantization.kernels import kernel_failure, load_kernels


@pytest.fixture(autouse=True)
def _restore_ops():
    previous = current_ops()
    yield
    set_current_ops(previous)


@pytest.fixture(scope="module")
def kernels():
    """The built kernel module (the first run on a machine builds it: ~30 s)."""
    module = load_kernels()
    assert module is not None, f"the cpu kernels must build on this machine: {kernel_failure()}"
    return module
