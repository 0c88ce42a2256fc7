"""MetaX GPUs (C550) as Paddle exposes them: the custom device ``metax_gpu`` (PaddleCustomDevice runtime)."""

from __future__ import annotations

from fastdeploy_core.devices.custom import PaddleCustomDevice

from fd_metax.ops import MetaxOps


class MetaxGpu(PaddleCustomDevice):
    """``--device metax_gpu``: Paddle with the ``metax_gpu`` custom-device runtime loaded and a chip visible.

    Detection asks ``paddle.device.get_all_custom_device_type()`` and
    ``paddle.device.custom_device.device_count("metax_gpu")``; collectives go through Paddle's
    ``xccl`` with ``PADDLE_XCCL_BACKEND=metax_gpu`` (see :attr:`dist_env`).
    """

    name = "metax_gpu"
    paddle_device_type = "metax_gpu"
    priority = 80
    supported_dtypes = ("bfloat16", "float16", "float32")
    supports_graph_capture = False
    # FastDeploy docs/get_started/installation/metax_gpu.md runs ERNIE-4.5 with quantization="wint8" (use_cudagraph False).
    quantization_methods = ("wint8",)
    attention_backends = MetaxOps.attention_backends
    package = "fd-metax"
    runtime_package = "paddle-metax-gpu"
    visible_devices_env = "MACA_VISIBLE_DEVICES"
    ops_class = MetaxOps
