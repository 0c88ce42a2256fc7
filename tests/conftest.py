"""Shared test set-up: thread count before Paddle is imported anywhere, offline model hubs."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402


@pytest.fixture
def restore_ops():
    """Put the process-wide ops table back after a test that installs another one."""
    from fastdeploy_core.devices.current import current_ops, set_current_ops

    previous = current_ops()
    yield
    set_current_ops(previous)
