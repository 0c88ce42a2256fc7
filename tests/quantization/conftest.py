"""Every quantization test may install an ops table: the core's pytest plugin restores it."""

import pytest


@pytest.fixture(autouse=True)
def _put_back_the_ops_table(restore_ops):
    yield
