"""Attention-backend choice: --attention-backend, FD_ATTENTION_BACKEND, the default, and the errors."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest  # noqa: E402

from fastdeploy_core.builtin.cpu.device import CpuDevice  # noqa: E402
from fastdeploy_core.devices.reference_ops import ReferenceOps  # noqa: E402
from fastdeploy_core.errors import ConfigError  # noqa: E402
from fastdeploy_core.plugins import load_plugins  # noqa: E402

from fd_nvidia.device import NvidiaGpu  # noqa: E402


@pytest.fixture(autouse=True)
def _no_env_backend(monkeypatch):
    monkeypatch.delenv("FD_ATTENTION_BACKEND", raising=False)


def test_default_is_the_first_offered_backend():
    assert CpuDevice.select_attention_backend(None) == "paged_reference"
    assert NvidiaGpu.select_attention_backend(None) == "sdpa"
    assert NvidiaGpu.make_ops().attention_backend == "sdpa"


def test_explicit_choice_is_case_insensitive_and_builds_those_ops():
    assert NvidiaGpu.select_attention_backend("PAGED_REFERENCE") == "paged_reference"
    ops = NvidiaGpu.make_ops("paged_reference")
    assert type(ops) is NvidiaGpu.ops_class and ops.attention_backend == "paged_reference"


def test_environment_variable_applies_when_no_flag_is_given(monkeypatch):
    monkeypatch.setenv("FD_ATTENTION_BACKEND", "paged_reference")
    assert NvidiaGpu.select_attention_backend(None) == "paged_reference"
    assert NvidiaGpu.select_attention_backend("sdpa") == "sdpa"  # the flag wins over the environment


def test_unknown_name_lists_what_the_device_offers():
    with pytest.raises(ConfigError) as info:
        NvidiaGpu.select_attention_backend("APPEND_ATTN")
    message = str(info.value)
    assert "'APPEND_ATTN'" in message and "'gpu'" in message and "available: sdpa, paged_reference" in message
    assert info.value.param == "attention_backend" and info.value.http_status == 400


def test_unknown_name_from_the_environment_says_where_it_came_from(monkeypatch):
    monkeypatch.setenv("FD_ATTENTION_BACKEND", "flash")
    with pytest.raises(ConfigError, match="from FD_ATTENTION_BACKEND.*available: paged_reference"):
        CpuDevice.make_ops()


def test_a_backend_of_another_device_is_refused():
    with pytest.raises(ConfigError, match="not offered by device 'cpu'"):
        CpuDevice.select_attention_backend("sdpa")
    with pytest.raises(ValueError, match="implements attention backends paged_reference"):
        ReferenceOps(attention_backend="sdpa")


def test_every_registered_device_builds_ops_for_each_backend_it_offers():
    manager = load_plugins()
    for name in manager.devices.keys():
        device = manager.devices.get(name)
        for backend in device.attention_backends:
            assert device.make_ops(backend).attention_backend == backend, name
