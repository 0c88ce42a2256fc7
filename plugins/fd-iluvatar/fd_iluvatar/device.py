"""Iluvatar CoreX GPUs as Paddle exposes them: the custom device ``iluvatar_gpu`` (PaddleCustomDevice runtime)."""

from __future__ import annotations

from fastdeploy_core.devices.custom import PaddleCustomDevice

from fd_iluvatar.ops import IluvatarOps


class IluvatarGpu(PaddleCustomDevice):
    """``--device iluvatar_gpu``: Paddle with the ``iluvatar_gpu`` custom-device runtime loaded and a chip visible.

    Detection asks ``paddle.device.get_all_custom_device_type()`` and
    ``paddle.device.custom_device.device_count("iluvatar_gpu")``; collectives go through Paddle's
    ``xccl`` with ``PADDLE_XCCL_BACKEND=iluvatar_gpu`` (see :attr:`dist_env`).
    """

    name = "iluvatar_gpu"
    paddle_device_type = "iluvatar_gpu"
    priority = 80
    supported_dtypes = ("bfloat16", "float16", "float32")
    supports_graph_capture = True
    # FastDeploy docs/get_started/installation/iluvatar_gpu.md, "Quantization Format Support": wint8, wint4; its examples enable use_cudagraph.
    quantization_methods = ("wint8", "wint4")
    attention_backends = IluvatarOps.attention_backends
    package = "fd-iluvatar"
    runtime_package = "paddlepaddle-iluvatar"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ops_class = IluvatarOps
