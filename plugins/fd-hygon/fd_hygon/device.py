"""Hygon DCUs as Paddle's ROCm build exposes them (place ``gpu``, ``paddle.device.cuda`` APIs)."""

from __future__ import annotations

import os

from fastdeploy_core.devices import Availability, Device, MemoryInfo

from fd_hygon.ops import HygonOps


class HygonDcu(Device):
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

    @classmethod
    def detect(cls) -> Availability:
        import paddle

        if not paddle.is_compiled_with_rocm():
            return Availability.no(
                f"this Paddle {paddle.__version__} is not a ROCm build; install Paddle for DCU (DTK) "
                "from Hygon's image or https://www.paddlepaddle.org.cn/install"
            )
        if paddle.device.cuda.device_count() == 0:
            visible = os.environ.get("HIP_VISIBLE_DEVICES", "<unset>")
            return Availability.no(
                f"Paddle is built with ROCm but sees no DCU: check the driver (hy-smi) and HIP_VISIBLE_DEVICES={visible}"
            )
        return Availability.yes()

    @classmethod
    def device_count(cls) -> int:
        import paddle

        return int(paddle.device.cuda.device_count()) if cls.detect().available else 0

    @classmethod
    def memory_info(cls, index: int = 0) -> MemoryInfo:
        """Total from ``paddle.device.cuda.get_device_properties``; free = total minus Paddle's reservation.

        ``paddle.cuda.mem_get_info`` goes through Paddle's CUDA runtime binding
        (``libpaddle._cudart``); whether a ROCm build provides it has not been checked on a DCU,
        so the device-properties and allocator statistics are used instead.
        """
        import paddle

        total = int(paddle.device.cuda.get_device_properties(index).total_memory)
        reserved = int(paddle.device.cuda.memory_reserved(index))
        return MemoryInfo(total_bytes=total, free_bytes=max(total - reserved, 0))
