"""``w4a8``: symmetric int4 weights (groups along the input axis) with dynamic per-token int8 activations.

The weight storage is ``wint4``'s with ``has_zero_point`` off by default (a symmetric grid,
``offset = -8 * scale``, as integer W4A8 kernels expect); each row of ``x`` is rounded to int8
with its own scale before the matmul, as in ``w8a8``.
"""

from __future__ import annotations

from pydantic import Field

from fastdeploy_core.quantization.weight_only import WeightOnlyInt4, WeightOnlyInt4Config, int4_linear_reference


class W4A8Config(WeightOnlyInt4Config):
    has_zero_point: bool = Field(False, description="asymmetric groups; off: the symmetric grid integer kernels use")


class W4A8(WeightOnlyInt4):
    """``w4a8``: ``wint4`` storage, activations rounded to int8 per token."""

    name = "w4a8"
    expected_error = 0.2
    config_class = W4A8Config
    device_op = "w4a8_linear"
    #: its experts would need the int8-activation formula, which fused_moe does not have
    quantizes_experts = False

    @staticmethod
    def reference_op(x, weight, scale, offset, group_size, bias=None):
        return int4_linear_reference(x, weight, scale, offset, group_size, bias, act_int8=True)
