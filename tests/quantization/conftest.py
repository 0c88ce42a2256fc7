"""Fixtures of the quantization tests: the cpu kernels, and the ops table put back after each test."""

from __future__ import annotations

import pytest

from fastdeploy_core.builtin.cpu.kernels import kernel_failure, load_kernels


@pytest.fixture(autouse=True)
def _restore_ops(restore_ops):
    """Every quantization test may install an ops table; tests/conftest.py's fixture restores it."""
    yield


@pytest.fixture(scope="module")
def kernels():
    """The built kernel module (the first run on a machine builds it: ~30 s)."""
    module = load_kernels()
    assert module is not None, f"the cpu kernels must build on this machine: {kernel_failure()}"
    return module
