"""NVIDIA GPUs as Paddle's CUDA build exposes them (``paddle.device.cuda``, place ``gpu``)."""

from __future__ import annotations

import os

from fastdeploy_core.devices import Availability, Device, MemoryInfo

from fd_nvidia.ops import NvidiaOps


class NvidiaGpu(Device):
    """``--device gpu``: a CUDA build of Paddle (``paddlepaddle-gpu``) with at least one visible GPU."""

    name = "gpu"
    paddle_device_type = "gpu"
    priority = 100
    supported_dtypes = ("bfloat16", "float16", "float32")
    dist_backend = "nccl"
    supports_graph_capture = True  # CUDA graphs: paddle.device.cuda.graphs
    # FastDeploy docs/quantization/README.md lists these for "GPU" (block_wise_fp8: Hopper).
    quantization_methods = ("wint8", "wint4", "block_wise_fp8", "wint2", "mix_quant")
    attention_backends = NvidiaOps.attention_backends
    package = "fd-nvidia"
    ops_class = NvidiaOps

    @classmethod
    def detect(cls) -> Availability:
        import paddle

        if paddle.is_compiled_with_rocm():
            return Availability.no(
                f"this Paddle {paddle.__version__} is a ROCm build (Hygon DCU), not CUDA: use --device dcu (fd-hygon)"
            )
        if not paddle.is_compiled_with_cuda():
            return Availability.no(
                f"this Paddle {paddle.__version__} is not compiled with CUDA; install paddlepaddle-gpu "
                "(see https://www.paddlepaddle.org.cn/install)"
            )
        if paddle.device.cuda.device_count() == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
            return Availability.no(
                f"Paddle is built with CUDA but sees no GPU: check the driver (nvidia-smi) and "
                f"CUDA_VISIBLE_DEVICES={visible}"
            )
        return Availability.yes()

    @classmethod
    def device_count(cls) -> int:
        import paddle

        return int(paddle.device.cuda.device_count()) if cls.detect().available else 0

    @classmethod
    def memory_info(cls, index: int = 0) -> MemoryInfo:
        """``cudaMemGetInfo`` through ``paddle.cuda.mem_get_info`` (Paddle >= 3.2).

        Older Paddle lacks it; then total comes from ``get_device_properties`` and free is total
        minus what this process's allocator reserved (other processes' use is not seen).
        """
        import paddle

        mem_get_info = getattr(getattr(paddle, "cuda", None), "mem_get_info", None)
        if mem_get_info is not None:
            free, total = mem_get_info(index)
            return MemoryInfo(total_bytes=int(total), free_bytes=int(free))
        total = int(paddle.device.cuda.get_device_properties(index).total_memory)
        reserved = int(paddle.device.cuda.memory_reserved(index))
        return MemoryInfo(total_bytes=total, free_bytes=max(total - reserved, 0))
