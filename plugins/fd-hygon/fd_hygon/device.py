"""Hygon DCUs as Paddle's ROCm build exposes them (place ``gpu``, ``paddle.device.cuda`` APIs)."""

from __future__ import annotations

from fastdeploy_core.devices.builtin_backend import PaddleBuiltinDevice
from fd_hygon.ops import HygonOps


class HygonDcu(PaddleBuiltinDevice):
    """``--device dcu``: a ROCm/DTK build of Paddle with at least one visible DCU.

    Paddle's ROCm build keeps the CUDA-named Python API (``paddle.device.cuda``) and places
    tensors on ``gpu:N``; its collective backend is called ``nccl`` in ``paddle.distributed``
    and is implemented with RCCL.
    """

    name = "dcu"
    paddle_device_type = "gpu"
    priority = 95
    supported_dtypes = ("bfloat16", "float16", "float32")
    dist_backend = "nccl"  # RCCL behind Paddle's "nccl" name; Paddle has no "rccl" backend string
    supports_graph_capture = False
    # FastDeploy docs/get_started/installation/hygon_dcu.md serves ERNIE-4.5-300B with wint8.
    quantization_methods = ("wint8",)
    attention_backends = HygonOps.attention_backends
    package = "fd-hygon"
    ops_class = HygonOps

    compiled_with = "rocm"
    build_label = "ROCm"
    install_hint = "install Paddle for DCU (DTK) from Hygon's image or https://www.paddlepaddle.org.cn/install"
    runtime_module = "cuda"  # the ROCm build keeps the CUDA-named API
    unit = "DCU"
    driver_tool = "hy-smi"
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    # memory_info: the base's device properties and allocator statistics. Whether a ROCm build
    # provides paddle.cuda.mem_get_info (Paddle's CUDA runtime binding) was never checked on a DCU.
