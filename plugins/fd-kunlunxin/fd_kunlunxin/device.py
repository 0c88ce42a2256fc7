"""Kunlunxin XPUs as Paddle's XPU build exposes them (``paddle.device.xpu``, place ``xpu``)."""

from __future__ import annotations

import os

from fastdeploy_core.devices import Availability, Device, MemoryInfo

from fd_kunlunxin.ops import KunlunxinOps


class KunlunxinXpu(Device):
    """``--device xpu``: an XPU build of Paddle (``paddlepaddle-xpu``) with at least one visible XPU."""

    name = "xpu"
    paddle_device_type = "xpu"
    priority = 90
    supported_dtypes = ("bfloat16", "float16", "float32")
    dist_backend = "bkcl"
    supports_graph_capture = False
    # FastDeploy docs: quantization/README.md ("GPU, XPU": wint8, wint4, MixQuant) and
    # usage/kunlunxin_xpu_deployment.md (ERNIE-4.5-300B-A47B-W4A8C8 with --quantization W4A8).
    quantization_methods = ("wint8", "wint4", "mix_quant", "w4a8")
    attention_backends = KunlunxinOps.attention_backends
    package = "fd-kunlunxin"
    ops_class = KunlunxinOps

    @classmethod
    def detect(cls) -> Availability:
        import paddle

        if not paddle.is_compiled_with_xpu():
            return Availability.no(
                f"this Paddle {paddle.__version__} is not compiled with XPU support; install paddlepaddle-xpu "
                "(https://www.paddlepaddle.org.cn/packages/stable/xpu-p800/)"
            )
        if paddle.device.xpu.device_count() == 0:
            visible = os.environ.get("XPU_VISIBLE_DEVICES", "<unset>")
            return Availability.no(
                f"Paddle is built with XPU but sees no XPU: check the driver (xpu-smi) and XPU_VISIBLE_DEVICES={visible}"
            )
        return Availability.yes()

    @classmethod
    def device_count(cls) -> int:
        import paddle

        return int(paddle.device.xpu.device_count()) if cls.detect().available else 0

    @classmethod
    def memory_info(cls, index: int = 0) -> MemoryInfo:
        """``paddle.device.xpu.memory_total`` / ``memory_used``: the whole card as the XPU runtime sees it."""
        import paddle

        total = int(paddle.device.xpu.memory_total(index))
        used = int(paddle.device.xpu.memory_used(index))
        return MemoryInfo(total_bytes=total, free_bytes=max(total - used, 0))
