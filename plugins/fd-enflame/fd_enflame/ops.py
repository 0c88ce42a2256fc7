"""The gcu ops table: fused kernels where Paddle's gcu runtime registers them."""

from __future__ import annotations

from fastdeploy_core.devices.fused_ops import FusedOps


class EnflameOps(FusedOps):
    """Ops for Enflame GCUs (S60). Paddle's kernel registry is asked per call whether the ``gcu``
    runtime registers each fused kernel for the tensor's dtype; none is asserted here because
    none has been checked on the chip, so a missing kernel means the reference op, not an error."""

    attention_backends = ("sdpa", "paged_reference")
    expected_kernels = ()
