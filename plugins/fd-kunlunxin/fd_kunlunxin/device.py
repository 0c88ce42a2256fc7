"""Kunlunxin XPUs as Paddle's XPU build exposes them (``paddle.device.xpu``, place ``xpu``)."""

from __future__ import annotations

from fastdeploy_core.devices import MemoryInfo
from fastdeploy_core.devices.builtin_backend import PaddleBuiltinDevice
from fd_kunlunxin.ops import KunlunxinOps


class KunlunxinXpu(PaddleBuiltinDevice):
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

    compiled_with = "xpu"
    build_label = "XPU"
    install_hint = "install paddlepaddle-xpu (https://www.paddlepaddle.org.cn/packages/stable/xpu-p800/)"
    runtime_module = "xpu"
    unit = "XPU"
    driver_tool = "xpu-smi"
    visible_devices_env = "XPU_VISIBLE_DEVICES"

    @classmethod
    def memory_info(cls, index: int = 0) -> MemoryInfo:
        """``paddle.device.xpu.memory_total`` / ``memory_used``: the whole card as the XPU runtime sees it."""
        import paddle

        total = int(paddle.device.xpu.memory_total(index))
        used = int(paddle.device.xpu.memory_used(index))
        return MemoryInfo(total_bytes=total, free_bytes=max(total - used, 0))
