"""A base for chips Paddle builds in: CUDA, ROCm and Kunlunxin XPU builds of Paddle itself.

Such a chip needs no runtime plugin: the Paddle wheel is built for it (``paddlepaddle-gpu``,
``paddlepaddle-xpu``, Paddle for DTK), answers ``paddle.is_compiled_with_<build>()`` and
counts its devices through one runtime module (``paddle.device.cuda`` or ``paddle.device.xpu``).
Subclasses declare which build and which runtime; detection, device count and memory come from
here. Chips Paddle reaches through its custom-device runtime derive from
:class:`~fastdeploy_core.devices.custom.PaddleCustomDevice` instead.
"""

from __future__ import annotations

import os
from typing import ClassVar

from fastdeploy_core.devices.base import Availability, Device, MemoryInfo


class PaddleBuiltinDevice(Device):
    """A chip of a Paddle build compiled for it (``paddle.is_compiled_with_<compiled_with>()``)."""

    #: The build Paddle must be compiled with: ``"cuda"``, ``"rocm"`` or ``"xpu"``.
    compiled_with: ClassVar[str] = ""
    #: How the build is called in messages (``"CUDA"``, ``"ROCm"``, ``"XPU"``).
    build_label: ClassVar[str] = ""
    #: What a user does to get that build (named when Paddle is another build).
    install_hint: ClassVar[str] = ""
    #: ``paddle.device.<runtime_module>`` counts the devices and reports their memory.
    runtime_module: ClassVar[str] = "cuda"
    #: What one device is called in messages (``"GPU"``, ``"DCU"``, ``"XPU"``).
    unit: ClassVar[str] = ""
    #: The vendor's command that shows the driver sees the devices (``nvidia-smi``...).
    driver_tool: ClassVar[str] = ""
    #: Environment variable that restricts the visible devices (named when none is seen).
    visible_devices_env: ClassVar[str] = ""
    #: Builds that also answer ``is_compiled_with_<compiled_with>`` but are another chip
    #: (a ROCm build says it is compiled with CUDA): build -> the reason to give.
    other_builds: ClassVar[dict[str, str]] = {}

    @classmethod
    def _runtime(cls):
        import paddle

        return getattr(paddle.device, cls.runtime_module)

    @classmethod
    def detect(cls) -> Availability:
        import paddle

        for build, reason in cls.other_builds.items():
            if getattr(paddle, f"is_compiled_with_{build}")():
                return Availability.no(f"this Paddle {paddle.__version__} is a {reason}")
        if not getattr(paddle, f"is_compiled_with_{cls.compiled_with}")():
            return Availability.no(
                f"this Paddle {paddle.__version__} is not compiled with {cls.build_label}; {cls.install_hint}"
            )
        if int(cls._runtime().device_count()) == 0:
            visible = os.environ.get(cls.visible_devices_env, "<unset>")
            return Availability.no(
                f"Paddle is built with {cls.build_label} but sees no {cls.unit}: check the driver "
                f"({cls.driver_tool}) and {cls.visible_devices_env}={visible}"
            )
        return Availability.yes()

    @classmethod
    def device_count(cls) -> int:
        return int(cls._runtime().device_count()) if cls.detect().available else 0

    @classmethod
    def memory_info(cls, index: int = 0) -> MemoryInfo:
        """Total from the runtime's ``get_device_properties``; free = total minus what Paddle's
        allocator reserved in this process (other processes' use is not seen). Runtimes with a
        better source override this."""
        runtime = cls._runtime()
        total = int(runtime.get_device_properties(index).total_memory)
        reserved = int(runtime.memory_reserved(index))
        return MemoryInfo(total_bytes=total, free_bytes=max(total - reserved, 0))
