"""Enflame GCUs (S60) as Paddle exposes them: the custom device ``gcu`` (PaddleCustomDevice runtime)."""

from __future__ import annotations

from fastdeploy_core.devices.custom import PaddleCustomDevice

from fd_enflame.ops import EnflameOps


class EnflameGcu(PaddleCustomDevice):
    """``--device gcu``: Paddle with the ``gcu`` custom-device runtime loaded and a chip visible.

    Detection asks ``paddle.device.get_all_custom_device_type()`` and
    ``paddle.device.custom_device.device_count("gcu")``; collectives go through Paddle's
    ``xccl`` with ``PADDLE_XCCL_BACKEND=gcu`` (see :attr:`dist_env`).
    """

    name = "gcu"
    paddle_device_type = "gcu"
    priority = 80
    supported_dtypes = ("bfloat16", "float16", "float32")
    supports_graph_capture = False
    # FastDeploy docs/get_started/installation/Enflame_gcu.md serves ERNIE-4.5-300B with --quantization wint4.
    quantization_methods = ("wint4",)
    attention_backends = EnflameOps.attention_backends
    package = "fd-enflame"
    runtime_package = "paddle-custom-gcu"
    visible_devices_env = ""
    ops_class = EnflameOps
