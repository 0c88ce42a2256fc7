"""``w8a8``: int8 weights (per-channel) with dynamic per-token int8 activations.

Each row of ``x`` is rounded to int8 with its own scale (``|x|max / 127``) right before the
matmul; ``y = (x_q @ w_q) * x_scale * w_scale``. The storage is exactly ``wint8``'s. On the
cpu the products of the integer codes are formed in float32 (exact) and summed in float32:
there is no integer dot-product kernel, so the activation rounding costs accuracy without
buying speed here; it exists so a model quantized for W8A8 devices runs (and is checked) on
the cpu too.
"""

from __future__ import annotations

from fastdeploy_core.quantization.weight_only import WeightOnlyInt8, int8_linear_reference


class W8A8(WeightOnlyInt8):
    """``w8a8``: ``wint8`` storage, activations rounded to int8 per token."""

    name = "w8a8"
    expected_error = 0.03
    device_op = "w8a8_linear"
    #: its experts would need the int8-activation formula, which fused_moe does not have
    quantizes_experts = False

    @staticmethod
    def reference_op(x, weight, scale, group_size, bias=None):
        return int8_linear_reference(x, weight, scale, group_size, bias, act_int8=True)
