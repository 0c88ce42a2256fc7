"""The iluvatar_gpu ops table: fused kernels where Paddle's iluvatar_gpu runtime registers them."""

from __future__ import annotations

from fastdeploy_core.devices.fused_ops import FusedOps


class IluvatarOps(FusedOps):
    """Ops for Iluvatar CoreX GPUs. Paddle's kernel registry is asked per call whether the ``iluvatar_gpu``
    runtime registers each fused kernel for the tensor's dtype; none is asserted here because
    none has been checked on the chip, so a missing kernel means the reference op, not an error."""

    attention_backends = ("sdpa", "paged_reference")
    expected_kernels = ()
