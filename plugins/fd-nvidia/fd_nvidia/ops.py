"""The gpu ops table: Paddle's CUDA fused kernels, the reference ops where one is missing.

Everything is inherited from :class:`fastdeploy_core.devices.fused_ops.FusedOps`, which asks
Paddle's kernel registry per call whether the kernel exists for the tensor's place and dtype.
"""

from __future__ import annotations

from fastdeploy_core.devices.fused_ops import FusedOps


class NvidiaOps(FusedOps):
    """Ops for NVIDIA GPUs.

    Paddle's CUDA build registers ``fused_rms_norm_quant`` (RMSNorm, with the residual add
    fused), ``fused_rotary_position_embedding`` and ``swiglu`` for the GPU place; attention
    defaults to ``sdpa``, which Paddle routes to its flash-attention kernels on CUDA.
    """

    attention_backends = ("sdpa", "paged_reference")
    expected_kernels = ("fused_rms_norm_quant", "fused_rotary_position_embedding", "swiglu")
