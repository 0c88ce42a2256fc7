"""The dcu ops table: fused kernels where Paddle's ROCm build registers them for the gpu place."""

from __future__ import annotations

from fastdeploy_core.devices.fused_ops import FusedOps


class HygonOps(FusedOps):
    """Ops for Hygon DCUs. Which fused kernels the ROCm build registers is decided per call by
    Paddle's kernel registry; none is asserted here because none has been checked on a DCU."""

    attention_backends = ("sdpa", "paged_reference")
    expected_kernels = ()
