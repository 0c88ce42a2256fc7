"""The seven chip plugins: declarations, detection both ways, memory, and `--device` selection.

Detection is simulated by monkeypatching the Paddle APIs the plugins call (see simulate.py),
so every branch runs on this CPU-only machine; nothing here claims a chip was present.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest  # noqa: E402

from fastdeploy_core.devices.base import Availability, MemoryInfo  # noqa: E402
from fastdeploy_core.devices.builtin_backend import PaddleBuiltinDevice  # noqa: E402
from fastdeploy_core.devices.custom import PaddleCustomDevice  # noqa: E402
from fastdeploy_core.devices.fused_ops import FusedOps  # noqa: E402
from fastdeploy_core.errors import DeviceUnavailableError  # noqa: E402
from fastdeploy_core.plugins import load_plugins  # noqa: E402

from .simulate import simulate_paddle  # noqa: E402

# device name -> (distribution, paddle device type, dist backend, quantization methods (from FastDeploy docs, less
#                 those no registered method reads: gpu's wint2 and intel_hpu's tensor_wise_fp8 are offline
#                 checkpoint formats), dtypes, simulation that makes it available)
FULL = ("bfloat16", "float16", "float32")
CHIPS = {
    "gpu": ("fd-nvidia", "gpu", "nccl", ("wint8", "wint4", "block_wise_fp8", "mix_quant"), FULL, dict(cuda=True, gpus=2)),
    "dcu": ("fd-hygon", "gpu", "nccl", ("wint8",), FULL, dict(rocm=True, gpus=8)),
    "xpu": ("fd-kunlunxin", "xpu", "bkcl", ("wint8", "wint4", "mix_quant", "w4a8"), FULL, dict(xpu=True, xpus=8)),
    "iluvatar_gpu": ("fd-iluvatar", "iluvatar_gpu", "xccl", ("wint8", "wint4"), FULL, dict(custom={"iluvatar_gpu": 2})),
    "metax_gpu": ("fd-metax", "metax_gpu", "xccl", ("wint8",), FULL, dict(custom={"metax_gpu": 1})),
    "gcu": ("fd-enflame", "gcu", "xccl", ("wint4",), FULL, dict(custom={"gcu": 8})),
    "intel_hpu": ("fd-gaudi", "intel_hpu", "xccl", (), ("bfloat16", "float32"), dict(custom={"intel_hpu": 8})),
}


@pytest.fixture(scope="module")
def manager():
    return load_plugins()


@pytest.mark.parametrize("name", sorted(CHIPS))
def test_declaration_matches_paddle_and_fastdeploy_docs(manager, name):
    dist, device_type, backend, methods, dtypes, _ = CHIPS[name]
    device = manager.devices.get(name)
    assert device is not None, f"{dist} did not register {name!r}"
    assert manager.devices.entry(name).distribution == dist
    assert device.paddle_device_type == device_type
    assert device.dist_backend == backend
    assert device.quantization_methods == methods
    assert device.supported_dtypes == dtypes
    assert device.package == dist
    assert issubclass(device.ops_class, FusedOps)
    assert device.attention_backends == device.ops_class.attention_backends
    if backend == "xccl":
        assert device.dist_env == {"PADDLE_DISTRI_BACKEND": "xccl", "PADDLE_XCCL_BACKEND": device_type}


@pytest.mark.parametrize("name", sorted(CHIPS))
def test_unavailable_on_this_cpu_build_with_a_reason(manager, name):
    device = manager.devices.get(name)
    avail = device.detect()
    assert avail.available is False
    # The reason names what is missing on this CPU-only Paddle and what to install.
    import paddle

    if issubclass(device, PaddleCustomDevice):
        assert avail.reason == (
            f"Paddle {paddle.__version__} has no custom device {device.paddle_device_type!r} loaded (loaded custom "
            f"device types: none); install {device.runtime_package} (Paddle's {device.paddle_device_type} runtime)"
        )
    else:
        assert issubclass(device, PaddleBuiltinDevice)
        assert avail.reason == (
            f"this Paddle {paddle.__version__} is not compiled with {device.build_label}; {device.install_hint}"
        )
    assert device.device_count() == 0
    row = device.describe()
    assert row["available"] is False and row["reason"] == avail.reason and row["device_count"] == 0
    with pytest.raises(DeviceUnavailableError, match="not usable here"):
        manager.select_device(name)


@pytest.mark.parametrize("name", sorted(CHIPS))
def test_available_when_paddle_reports_the_chip(manager, monkeypatch, name):
    *_, available = CHIPS[name]
    simulate_paddle(monkeypatch, **available)
    device = manager.devices.get(name)
    assert device.detect() == Availability.yes()
    expected_count = available.get("gpus") or available.get("xpus") or next(iter(available.get("custom", {}).values()))
    assert device.device_count() == expected_count
    assert manager.select_device(name) is device
    info = device.memory_info(0)
    assert isinstance(info, MemoryInfo) and 0 <= info.free_bytes <= info.total_bytes
    row = device.describe()
    assert row["available"] is True and row["reason"] == "" and row["device_count"] == expected_count


def test_memory_info_reads_each_paddle_api(manager, monkeypatch):
    simulate_paddle(monkeypatch, cuda=True, gpus=1, gpu_memory=(5 << 30, 24 << 30))
    assert manager.devices.get("gpu").memory_info(0) == MemoryInfo(24 << 30, 5 << 30)
    simulate_paddle(monkeypatch, rocm=True, gpus=1, gpu_memory=(5 << 30, 64 << 30))
    assert manager.devices.get("dcu").memory_info(0) == MemoryInfo(64 << 30, 5 << 30)
    simulate_paddle(monkeypatch, xpu=True, xpus=1, xpu_memory=(96 << 30, 10 << 30))
    assert manager.devices.get("xpu").memory_info(0) == MemoryInfo(96 << 30, 86 << 30)
    simulate_paddle(monkeypatch, custom={"metax_gpu": 1}, custom_memory=(64 << 30, 4 << 30))
    assert manager.devices.get("metax_gpu").memory_info(0) == MemoryInfo(64 << 30, 60 << 30)


def test_custom_device_without_memory_properties_says_how_to_size_the_cache(manager, monkeypatch):
    import paddle

    simulate_paddle(monkeypatch, custom={"gcu": 1})

    def not_gpgpu(place):
        raise RuntimeError("get_device_properties is not supported for this device type")

    monkeypatch.setattr(paddle.device, "get_device_properties", not_gpgpu)
    with pytest.raises(DeviceUnavailableError, match="--num-gpu-blocks-override"):
        manager.devices.get("gcu").memory_info(0)


@pytest.mark.parametrize(
    "simulation, reason_part",
    [
        (dict(cuda=True, gpus=0), "sees no GPU"),
        (dict(rocm=True, gpus=2), "ROCm build"),
        (dict(), "not compiled with CUDA"),
    ],
)
def test_gpu_unavailable_reasons_are_precise(manager, monkeypatch, simulation, reason_part):
    simulate_paddle(monkeypatch, **simulation)
    assert reason_part in manager.devices.get("gpu").detect().reason


def test_custom_device_loaded_but_no_chip_visible(manager, monkeypatch):
    simulate_paddle(monkeypatch, custom={"metax_gpu": 0, "gcu": 2})
    monkeypatch.setenv("MACA_VISIBLE_DEVICES", "7")
    reason = manager.devices.get("metax_gpu").detect().reason
    assert "reports 0 devices" in reason and "MACA_VISIBLE_DEVICES=7" in reason
    reason = manager.devices.get("iluvatar_gpu").detect().reason
    assert "loaded custom device types: metax_gpu, gcu" in reason and "paddlepaddle-iluvatar" in reason


def test_xpu_sees_no_card(manager, monkeypatch):
    simulate_paddle(monkeypatch, xpu=True, xpus=0)
    monkeypatch.setenv("XPU_VISIBLE_DEVICES", "")
    reason = manager.devices.get("xpu").detect().reason
    assert "sees no XPU" in reason and "XPU_VISIBLE_DEVICES=" in reason


@pytest.mark.parametrize(
    "simulation, expected",
    [
        (dict(), "cpu"),
        (dict(custom={"metax_gpu": 1}), "metax_gpu"),
        (dict(xpu=True, xpus=2, custom={"gcu": 4}), "xpu"),
        (dict(cuda=True, gpus=1, custom={"iluvatar_gpu": 1}), "gpu"),
        (dict(rocm=True, gpus=1), "dcu"),
        (dict(cuda=True, gpus=0, custom={"intel_hpu": 2}), "intel_hpu"),
    ],
)
def test_auto_picks_the_highest_priority_available_device(manager, monkeypatch, simulation, expected):
    simulate_paddle(monkeypatch, **simulation)
    chosen = manager.select_device("auto")
    assert chosen.name == expected
    available = [manager.devices.get(n) for n in manager.devices.keys() if manager.devices.get(n).detect().available]
    assert chosen.priority == max(d.priority for d in available)


def test_a_detector_that_raises_is_reported_not_fatal(manager, monkeypatch):
    import paddle

    def broken():
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(paddle, "is_compiled_with_xpu", broken)
    row = manager.devices.get("xpu").describe()
    assert row["available"] is False and "driver exploded" in row["reason"]
    assert manager.select_device("auto").name == "cpu"
