"""The default KV budget is the device's rule; exact sizes parse and conflict clearly."""

from __future__ import annotations

import pytest

from fastdeploy_core.builtin.cpu.device import CpuDevice
from fastdeploy_core.config import EngineArgs
from fastdeploy_core.devices.base import Device
from fastdeploy_core.errors import ConfigError

MiB = 1 << 20
GiB = 1 << 30
SEQ = 360 * MiB  # the default model: 8192 tokens x 45 KiB


class OwnMemory(Device):
    name = "card"


def budget(device, free, seqs=64, util=None, activation=500 * MiB, seq=SEQ):
    return device.default_kv_budget(
        free_bytes=free,
        activation_bytes=activation,
        sequence_bytes=seq,
        max_num_seqs=seqs,
        gpu_memory_utilization=util,
    )


def test_host_memory_takes_a_quarter_of_what_is_available():
    assert CpuDevice.memory_shared_with_host and not OwnMemory.memory_shared_with_host
    chosen = budget(CpuDevice, 20 * GiB)
    assert chosen.bytes == 5 * GiB
    assert chosen.rule.startswith("cpu memory is the host's: the smaller of 25% of 20480 MiB available")
    assert "64 sequences of max_model_len need 23040 MiB" in chosen.rule
    assert budget(CpuDevice, 20 * GiB, seqs=4).bytes == 4 * SEQ  # what the sequences need, if less


def test_host_memory_budget_never_below_one_sequence_when_it_fits():
    chosen = budget(CpuDevice, 1 * GiB)  # a quarter is 256 MiB, one sequence 360 MiB
    assert chosen.bytes == SEQ and "raised to one max_model_len sequence (360 MiB)" in chosen.rule
    assert budget(CpuDevice, 600 * MiB).bytes == 150 * MiB  # no room: the runner refuses it


def test_own_memory_keeps_fastdeploy_utilization():
    chosen = budget(OwnMemory, 20 * GiB)
    assert chosen.bytes == int(20 * GiB * 0.9) - 500 * MiB
    assert chosen.rule.startswith("--gpu-memory-utilization 0.9 of 20480 MiB free card memory")
    assert budget(OwnMemory, 80 * GiB).bytes == 64 * SEQ  # capped at what max_num_seqs need
    # an explicit share on a host-memory device is that share, as on a card
    assert budget(CpuDevice, 20 * GiB, util=0.5).bytes == 10 * GiB - 500 * MiB


@pytest.mark.parametrize(
    ("given", "expected"),
    [("2GiB", 2 * GiB), ("512 MiB", 512 * MiB), ("1.5GB", 1_500_000_000), ("4096", 4096), (123, 123)],
)
def test_kv_cache_memory_parses_sizes(given, expected):
    assert EngineArgs.create(kv_cache_memory=given).cache.kv_cache_memory == expected


def test_kv_cache_memory_refuses_bad_sizes_and_a_second_size():
    with pytest.raises(ConfigError, match="kv_cache_memory: got '2 zonks'; give bytes as a number"):
        EngineArgs.create(kv_cache_memory="2 zonks")
    with pytest.raises(ConfigError, match="kv_cache_memory: got 0; must be >= 1"):
        EngineArgs.create(kv_cache_memory=0)
    with pytest.raises(ConfigError, match=r"the KV cache size is given twice \(num_gpu_blocks_override=8, kv_cache"):
        EngineArgs.create(kv_cache_memory="1GiB", num_gpu_blocks_override=8)
    with pytest.raises(ConfigError, match="given twice"):
        EngineArgs.create(kv_cache_memory="1GiB", gpu_memory_utilization=0.5)
