"""Simulate what Paddle reports about the machine, by monkeypatching the very APIs the plugins call."""

from __future__ import annotations

from types import SimpleNamespace

import paddle
from paddle.device import custom_device


def simulate_paddle(
    monkeypatch,
    *,
    cuda: bool = False,
    rocm: bool = False,
    xpu: bool = False,
    gpus: int = 0,
    xpus: int = 0,
    custom: dict[str, int] | None = None,
    gpu_memory: tuple[int, int] = (6 << 30, 16 << 30),  # (free, total)
    xpu_memory: tuple[int, int] = (90 << 30, 96 << 30),  # (total, used)
    custom_memory: tuple[int, int] = (64 << 30, 1 << 30),  # (total, reserved)
) -> None:
    """Pretend Paddle is a CUDA/ROCm/XPU build with ``gpus``/``xpus`` devices and ``custom`` runtimes."""
    custom = dict(custom or {})
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: cuda or rocm)
    monkeypatch.setattr(paddle, "is_compiled_with_rocm", lambda: rocm)
    monkeypatch.setattr(paddle, "is_compiled_with_xpu", lambda: xpu)
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: gpus if (cuda or rocm) else 0)
    monkeypatch.setattr(paddle.device.xpu, "device_count", lambda: xpus if xpu else 0)
    monkeypatch.setattr(paddle.device, "get_all_custom_device_type", lambda: list(custom) or None)
    monkeypatch.setattr(custom_device, "device_count", lambda device_type=None: custom.get(device_type, 0))

    free, total = gpu_memory
    monkeypatch.setattr(paddle.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(paddle.device.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(paddle.device.cuda, "memory_reserved", lambda device=None: total - free)
    xpu_total, xpu_used = xpu_memory
    monkeypatch.setattr(paddle.device.xpu, "memory_total", lambda device=None: xpu_total)
    monkeypatch.setattr(paddle.device.xpu, "memory_used", lambda device=None: xpu_used)
    c_total, c_reserved = custom_memory

    def properties(place):
        device_type = str(place).split(":")[0]
        if device_type not in custom:
            raise ValueError(f"no custom device {device_type}")
        return SimpleNamespace(total_memory=c_total)

    monkeypatch.setattr(paddle.device, "get_device_properties", properties)
    monkeypatch.setattr(custom_device, "memory_reserved", lambda device=None: c_reserved)
