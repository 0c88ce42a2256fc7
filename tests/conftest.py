"""Shared test set-up: thread count before Paddle is imported anywhere, offline model hubs."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The fixtures every test directory shares (``restore_ops``, ``cpu_kernels``) come from the
# pytest plugin the core installs: fastdeploy_core/testing/pytest_plugin.py.
