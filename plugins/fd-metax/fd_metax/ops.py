"""The metax_gpu ops table: fused kernels where Paddle's metax_gpu runtime registers them."""

from __future__ import annotations

from fastdeploy_core.devices.fused_ops import FusedOps


class MetaxOps(FusedOps):
    """Ops for MetaX GPUs (C550). Paddle's kernel registry is asked per call whether the ``metax_gpu``
    runtime registers each fused kernel for the tensor's dtype; none is asserted here because
    none has been checked on the chip, so a missing kernel means the reference op, not an error."""

    attention_backends = ("sdpa", "paged_reference")
    expected_kernels = ()
