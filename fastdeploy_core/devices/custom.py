"""A base for chips Paddle drives as *custom devices* (PaddleCustomDevice plugins).

Such a chip appears in ``paddle.device.get_all_custom_device_type()`` once the vendor's Paddle
plugin wheel (which drops a runtime library into ``paddle_custom_device/``) is installed; its
collective backend is Paddle's ``xccl`` with ``PADDLE_XCCL_BACKEND`` naming the device type.
Subclasses set :attr:`Device.name`, :attr:`Device.paddle_device_type` and
:attr:`runtime_package`; detection, device count and memory come from here.
"""

from __future__ import annotations

import os
from typing import ClassVar

from fastdeploy_core.devices.base import Availability, Device, MemoryInfo
from fastdeploy_core.errors import DeviceUnavailableError


class PaddleCustomDevice(Device):
    """A chip reached through Paddle's custom-device runtime (``paddle.CustomPlace``)."""

    dist_backend = "xccl"
    #: The vendor's Paddle runtime wheel, named in the "not available" reason.
    runtime_package: ClassVar[str] = ""
    #: Environment variable that restricts the visible chips (named in the reason when none is seen).
    visible_devices_env: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.paddle_device_type and "dist_env" not in cls.__dict__:
            cls.dist_env = {"PADDLE_DISTRI_BACKEND": "xccl", "PADDLE_XCCL_BACKEND": cls.paddle_device_type}

    @classmethod
    def detect(cls) -> Availability:
        import paddle

        types = list(paddle.device.get_all_custom_device_type() or [])
        if cls.paddle_device_type not in types:
            loaded = ", ".join(types) if types else "none"
            hint = f"install {cls.runtime_package} (Paddle's {cls.paddle_device_type} runtime)" if cls.runtime_package else ""
            return Availability.no(
                f"Paddle {paddle.__version__} has no custom device {cls.paddle_device_type!r} loaded "
                f"(loaded custom device types: {loaded}); {hint}".rstrip("; ")
            )
        count = cls._count()
        if count == 0:
            visible = ""
            if cls.visible_devices_env:
                visible = f"; {cls.visible_devices_env}={os.environ.get(cls.visible_devices_env, '<unset>')}"
            return Availability.no(
                f"Paddle's {cls.paddle_device_type} runtime is loaded but reports 0 devices: check the driver{visible}"
            )
        return Availability.yes()

    @classmethod
    def _count(cls) -> int:
        from paddle.device import custom_device

        return int(custom_device.device_count(cls.paddle_device_type))

    @classmethod
    def device_count(cls) -> int:
        return cls._count() if cls.detect().available else 0

    @classmethod
    def memory_info(cls, index: int = 0) -> MemoryInfo:
        """Total from ``paddle.device.get_device_properties``; free = total minus what Paddle reserved.

        Paddle exposes device properties only for "gpgpu" custom backends; for the others this
        raises :class:`DeviceUnavailableError` and the KV cache size must be given with
        ``--num-gpu-blocks-override``. Memory held by other processes is not seen.
        """
        import paddle
        from paddle.device import custom_device

        place = f"{cls.paddle_device_type}:{index}"
        try:
            total = int(paddle.device.get_device_properties(place).total_memory)
        except (RuntimeError, ValueError) as exc:
            raise DeviceUnavailableError(
                f"Paddle does not report the memory of {place} ({exc}); pass --num-gpu-blocks-override "
                "to size the KV cache by hand"
            ) from exc
        reserved = int(custom_device.memory_reserved(place))
        return MemoryInfo(total_bytes=total, free_bytes=max(total - reserved, 0))
