"""``w8a8``: int8 weights (per-channel) with dynamic per-token int8 activations.

Each row of ``x`` is rounded to int8 with its own scale (``|x|max / 127``) right before the
matmul; ``y = (x_q @ w_q) * x_scale * w_scale``. The storage is exactly ``wint8``'s. A device
may lay the codes out for integer products (``ops.prepare_w8a8_weights``): the cpu device does
with integer dot products (``vpdpbusd`` on AVX-512 VNNI, ``vpmaddubsw`` on AVX2), summing in
int32, so a step of many rows multiplies 4 byte pairs per lane and instruction where float32
multiplies one. Elsewhere (group scales, no integer dot products) the products of the codes
are formed in float32 (exact) and summed in float32, which the reference formula states.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fastdeploy_core.quantization.weight_only import WeightOnlyInt8, WeightOnlyInt8Config, int8_linear_reference


class W8A8Config(WeightOnlyInt8Config):
    lm_head_quant_type: Literal["wint8", "w8a8"] | None = Field(
        "wint8",
        description="the LM head as per-channel int8: wint8 (float or 16-bit activations) or w8a8 (int8 activations, "
        "integer products); None keeps it float32",
    )


class W8A8(WeightOnlyInt8):
    """``w8a8``: ``wint8`` storage, activations rounded to int8 per token."""

    name = "w8a8"
    config_class = W8A8Config
    expected_error = 0.03
    device_op = "w8a8_linear"
    fused_silu_op = "w8a8_linear_silu_and_mul"
    fused_argmax_op = "w8a8_linear_argmax"
    device_layout = "prepare_w8a8_weights"
    #: its experts would need the int8-activation formula, which fused_moe does not have
    quantizes_experts = False

    @staticmethod
    def reference_op(x, weight, scale, group_size, bias=None):
        return int8_linear_reference(x, weight, scale, group_size, bias, act_int8=True)
