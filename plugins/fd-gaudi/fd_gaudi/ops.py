"""The intel_hpu ops table: fused kernels where Paddle's intel_hpu runtime registers them."""

from __future__ import annotations

from fastdeploy_core.devices.fused_ops import FusedOps


class GaudiOps(FusedOps):
    """Ops for Intel Gaudi HPUs. Paddle's kernel registry is asked per call whether the ``intel_hpu``
    runtime registers each fused kernel for the tensor's dtype; none is asserted here because
    none has been checked on the chip, so a missing kernel means the reference op, not an error."""

    attention_backends = ("sdpa", "paged_reference")
    expected_kernels = ()
