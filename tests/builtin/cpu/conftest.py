"""Every test of the cpu device may install its ops table: the core's pytest plugin restores it."""

import pytest


@pytest.fixture(autouse=True)
def _restore_ops(restore_ops):
    yield
