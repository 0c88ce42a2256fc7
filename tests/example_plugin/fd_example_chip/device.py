"""The device declaration: what the chip is, how to find it, what it runs."""

from __future__ import annotations

import os

from fastdeploy_core.devices import Availability, Device, MemoryInfo

from fd_example_chip.ops import ExampleOps


class ExampleChip(Device):
    """``--device example_chip``: computes on Paddle's CPU place through :class:`ExampleOps`."""

    name = "example_chip"
    paddle_device_type = "cpu"
    priority = -10  # below the built-in cpu: `--device auto` never prefers an example
    supported_dtypes = ("float32",)
    dist_backend = "gloo"
    attention_backends = ExampleOps.attention_backends
    package = "fd-example-chip"
    ops_class = ExampleOps

    @classmethod
    def detect(cls) -> Availability:
        if os.environ.get("FD_EXAMPLE_CHIP_DISABLE"):
            return Availability.no("disabled by FD_EXAMPLE_CHIP_DISABLE")
        return Availability.yes()

    @classmethod
    def memory_info(cls, index: int = 0) -> MemoryInfo:
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page)
