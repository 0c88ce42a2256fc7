"""The xpu ops table: fused kernels where Paddle's XPU build registers them for the xpu place."""

from __future__ import annotations

from fastdeploy_core.devices.fused_ops import FusedOps


class KunlunxinOps(FusedOps):
    """Ops for Kunlunxin XPUs. Whether the XPU build registers each fused kernel is decided per
    call by Paddle's kernel registry; none is asserted here because none has been checked on an XPU.
    (Paddle's XPU-only ``block_multihead_attention_xpu`` is not wired: it needs FastDeploy's
    cache layout and was never run here.)"""

    attention_backends = ("sdpa", "paged_reference")
    expected_kernels = ()
