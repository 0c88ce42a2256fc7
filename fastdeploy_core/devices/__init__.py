"""Devices: the :class:`Device` contract, the built-in cpu device, and the current device."""

from fastdeploy_core.devices.base import Availability, Device, MemoryInfo

__all__ = ["Availability", "Device", "MemoryInfo"]
