"""NVIDIA GPUs as Paddle's CUDA build exposes them (``paddle.device.cuda``, place ``gpu``)."""

from __future__ import annotations

from fastdeploy_core.devices import MemoryInfo
from fastdeploy_core.devices.builtin_backend import PaddleBuiltinDevice
from fd_nvidia.ops import NvidiaOps


class NvidiaGpu(PaddleBuiltinDevice):
    """``--device gpu``: a CUDA build of Paddle (``paddlepaddle-gpu``) with at least one visible GPU."""

    name = "gpu"
    paddle_device_type = "gpu"
    priority = 100
    supported_dtypes = ("bfloat16", "float16", "float32")
    dist_backend = "nccl"
    supports_graph_capture = True  # CUDA graphs: paddle.device.cuda.graphs
    # FastDeploy docs/quantization/README.md lists these for "GPU" (block_wise_fp8: Hopper), and wint2,
    # which is not declared: it loads only checkpoints compressed offline with CCQ (convolutional coding,
    # MoE weights), a format no method here reads.
    quantization_methods = ("wint8", "wint4", "block_wise_fp8", "mix_quant")
    attention_backends = NvidiaOps.attention_backends
    package = "fd-nvidia"
    ops_class = NvidiaOps

    compiled_with = "cuda"
    build_label = "CUDA"
    install_hint = "install paddlepaddle-gpu (see https://www.paddlepaddle.org.cn/install)"
    runtime_module = "cuda"
    unit = "GPU"
    driver_tool = "nvidia-smi"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    other_builds = {"rocm": "ROCm build (Hygon DCU), not CUDA: use --device dcu (fd-hygon)"}

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
        return super().memory_info(index)
