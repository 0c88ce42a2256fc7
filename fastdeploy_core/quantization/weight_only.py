"""Weight-only quantization: ``wint8`` (per-channel int8) and ``wint4`` (group-wise int4).

Activations stay float32; weights are stored compact in Paddle's ``[in, out]`` orientation
and widened inside the matmul (the cpu device's C++ kernel reads them directly). A device may
lay them out for integer products instead (``ops.prepare_wint8_weights``, ``ops.prepare_int4_weights``):
the cpu device with integer dot products rounds the activations to 16 bits held as two int8
pieces (wint8 per row, wint4 per block of 32 inputs), each row by itself, so outputs stay
independent of the batch.

* ``wint8``: ``weight int8 [K, N]``, ``weight_scale [G, N]`` with ``w = q * scale``,
  ``q`` in [-127, 127], ``scale = max|w| / 127`` per output channel (``G = 1``) or per group of
  ``group_size`` input rows. A GGUF Q8_0 tensor loads as groups of 32 exactly as stored.
* ``wint4``: two 4-bit codes per byte, ``weight uint8 [K / 2, N]`` (row ``2p`` in the low,
  row ``2p + 1`` in the high nibble), ``weight_scale`` and ``weight_offset [G, N]`` with
  ``w = q * scale + offset``, ``q`` in [0, 15]. With ``has_zero_point`` (default) each group
  maps its own ``[min, max]`` onto the 16 levels; without it the grid is symmetric
  (``offset = -8 * scale``, ``scale = max|w| / 7``). GGUF Q4_0 / Q4_1 load as groups of 32
  exactly as stored. Groups run along the input axis; when ``K`` is not a multiple of
  ``group_size`` the last group is shorter.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
import paddle
from pydantic import Field

from fastdeploy_core.devices.current import current_ops
from fastdeploy_core.quantization.base import QuantizerBase, QuantizerConfig, add_bias, expand_groups
from fastdeploy_core.quantization.codes import num_groups, quantize_int4, quantize_int8


# ---- the formulas every device op must match ----------------------------------------------------
def int8_weight(weight: paddle.Tensor, scale: paddle.Tensor, group_size: int) -> paddle.Tensor:
    """Float32 ``[K, N]`` from int8 codes ``[K, N]`` and group scales ``[G, N]``."""
    rows = int(weight.shape[0])
    return weight.astype("float32") * expand_groups(scale, group_size, rows)


def int4_codes(packed: paddle.Tensor) -> paddle.Tensor:
    """``uint8 [K / 2, N]`` -> float32 codes ``[K, N]`` in [0, 15] (rows interleaved back)."""
    wide = packed.astype("int32")
    low = paddle.bitwise_and(wide, paddle.full([], 15, dtype="int32"))
    high = paddle.bitwise_right_shift(wide, paddle.full([], 4, dtype="int32"))
    rows, cols = int(packed.shape[0]), int(packed.shape[1])
    return paddle.stack([low, high], axis=1).reshape([2 * rows, cols]).astype("float32")


def int4_weight(packed: paddle.Tensor, scale: paddle.Tensor, offset: paddle.Tensor, group_size: int) -> paddle.Tensor:
    """Float32 ``[K, N]`` from packed int4 codes, group scales and offsets."""
    codes = int4_codes(packed)
    rows = int(codes.shape[0])
    # a device may store them as float16 when that is exact (the cpu ops do for GGUF's d and m)
    scale, offset = scale.astype("float32"), offset.astype("float32")
    return codes * expand_groups(scale, group_size, rows) + expand_groups(offset, group_size, rows)


def quantize_rows_int8(x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Dynamic per-row int8 of activations: integer-valued float32 codes and ``[..., 1]`` scales."""
    amax = paddle.max(paddle.abs(x), axis=-1, keepdim=True)
    scale = paddle.where(amax > 0, amax / 127.0, paddle.ones_like(amax))
    codes = paddle.clip(paddle.round(x / scale), -127.0, 127.0)
    return codes, scale


def int8_linear_reference(x, weight, scale, group_size: int, bias=None, act_int8: bool = False) -> paddle.Tensor:
    """``x @ (q * scale) (+ bias)``; with ``act_int8`` x is first rounded to int8 per row."""
    if act_int8:
        codes, row_scale = quantize_rows_int8(x)
        return add_bias(paddle.matmul(codes, int8_weight(weight, scale, group_size)) * row_scale, bias)
    return add_bias(paddle.matmul(x, int8_weight(weight, scale, group_size)), bias)


def int4_linear_reference(
    x, weight, scale, offset, group_size: int, bias=None, act_int8: bool = False
) -> paddle.Tensor:
    """``x @ (q * scale + offset) (+ bias)``; with ``act_int8`` x is first rounded to int8 per row."""
    if act_int8:
        codes, row_scale = quantize_rows_int8(x)
        return add_bias(paddle.matmul(codes, int4_weight(weight, scale, offset, group_size)) * row_scale, bias)
    return add_bias(paddle.matmul(x, int4_weight(weight, scale, offset, group_size)), bias)


# ---- the methods -----------------------------------------------------------------------------
class WeightOnlyInt8Config(QuantizerConfig):
    embedding_quant_type: Literal["wint8"] | None = Field("wint8", description="int8 token embedding (None: float32)")
    lm_head_quant_type: Literal["wint8"] | None = Field("wint8", description="int8 LM head (None: float32)")
    group_size: int | None = Field(None, ge=1, description="rows per scale; None = one scale per output channel")


class WeightOnlyInt8(QuantizerBase):
    """``wint8``: int8 weights with per-channel (or per-group) scales, float32 activations."""

    name = "wint8"
    expected_error = 0.02
    config_class = WeightOnlyInt8Config
    device_op = "wint8_linear"
    fused_silu_op = "wint8_linear_silu_and_mul"
    fused_argmax_op = "wint8_linear_argmax"
    gguf_types: ClassVar[tuple[str, ...]] = ("Q8_0",)
    act_int8: ClassVar[bool] = False
    quantizes_experts = True

    def group_size_for(self, rows: int) -> int:
        return self.config.group_size or rows

    def storage_shapes(self, input_size: int, output_size: int):
        groups = num_groups(input_size, self.group_size_for(input_size))
        return {"weight": ([input_size, output_size], "int8"), "weight_scale": ([groups, output_size], "float32")}

    def quantize(self, weight: np.ndarray) -> dict[str, np.ndarray]:
        return quantize_int8(weight, self.group_size_for(weight.shape[0]))

    def accepts_gguf(self, type_name: str) -> bool:
        # Q8_0 blocks are groups of 32 input rows: they fit storage made for group_size 32.
        return type_name in self.gguf_types and self.config.group_size == 32

    def load_gguf(self, blocks) -> dict[str, np.ndarray]:
        from fastdeploy_core.quantization.gguf import q8_0_to_int8

        return q8_0_to_int8(blocks)

    def dequantize(self, layer) -> paddle.Tensor:
        plain = current_ops().unprepare_linear_weight
        return int8_weight(plain(layer.weight), plain(layer.weight_scale), self.group_size_for(layer.input_size))

    def op_args(self, layer) -> tuple:
        return layer.weight, layer.weight_scale, self.group_size_for(layer.input_size)

    def weight_from_storage(self, tensors, rows: int) -> paddle.Tensor:
        return int8_weight(tensors["weight"], tensors["weight_scale"], self.group_size_for(rows))

    @staticmethod
    def reference_op(x, weight, scale, group_size, bias=None):
        return int8_linear_reference(x, weight, scale, group_size, bias)

    #: the ops table's method that lays codes and scales out for integer products (the cpu ops'
    #: int8 quads; ``wint8``'s activations then go in two int8 pieces)
    device_layout: ClassVar[str] = "prepare_wint8_weights"

    def process_weights_after_loading(self, layer) -> None:
        """The device's integer-product layout for codes and scales when it has one
        (:attr:`device_layout`), else as every method."""
        if not (hasattr(current_ops(), self.device_op) and self.adopt_device_layout(
                layer, self.device_layout, ("weight", "weight_scale"))):
            super().process_weights_after_loading(layer)


class WeightOnlyInt4Config(QuantizerConfig):
    embedding_quant_type: Literal["wint8"] | None = Field("wint8", description="int8 token embedding (None: float32)")
    lm_head_quant_type: Literal["wint8"] | None = Field("wint8", description="int8 LM head (None: float32)")
    group_size: int = Field(128, ge=2, description="input rows per scale (even); the last group may be shorter")
    has_zero_point: bool = Field(True, description="asymmetric groups (min..max) instead of a symmetric grid")


class WeightOnlyInt4(QuantizerBase):
    """``wint4``: 4-bit weights in groups along the input axis, float32 activations."""

    name = "wint4"
    expected_error = 0.15
    config_class = WeightOnlyInt4Config
    device_op = "wint4_linear"
    gguf_types: ClassVar[tuple[str, ...]] = ("Q4_0", "Q4_1")
    quantizes_experts = True

    def __init__(self, config=None):
        super().__init__(config)
        if self.config.group_size % 2:
            from fastdeploy_core.errors import QuantizationError

            raise QuantizationError(
                f"{self.name}: group_size must be even (two 4-bit rows share a byte), got {self.config.group_size}",
                param="quantization",
            )

    def storage_shapes(self, input_size: int, output_size: int):
        if input_size % 2:
            from fastdeploy_core.errors import QuantizationError

            raise QuantizationError(f"{self.name} needs an even input size, the layer has {input_size}")
        groups = num_groups(input_size, self.config.group_size)
        return {
            "weight": ([input_size // 2, output_size], "uint8"),
            "weight_scale": ([groups, output_size], "float32"),
            "weight_offset": ([groups, output_size], "float32"),
        }

    def quantize(self, weight: np.ndarray) -> dict[str, np.ndarray]:
        return quantize_int4(weight, self.config.group_size, self.config.has_zero_point)

    def accepts_gguf(self, type_name: str) -> bool:
        return type_name in self.gguf_types and self.config.group_size == 32

    def load_gguf(self, blocks) -> dict[str, np.ndarray]:
        from fastdeploy_core.quantization.gguf import q4_to_int4

        return q4_to_int4(blocks)

    def dequantize(self, layer) -> paddle.Tensor:
        plain = current_ops().unprepare_linear_weight
        return int4_weight(
            plain(layer.weight), plain(layer.weight_scale), plain(layer.weight_offset), self.config.group_size
        )

    def op_args(self, layer) -> tuple:
        return layer.weight, layer.weight_scale, layer.weight_offset, self.config.group_size

    def weight_from_storage(self, tensors, rows: int) -> paddle.Tensor:
        return int4_weight(tensors["weight"], tensors["weight_scale"], tensors["weight_offset"], self.config.group_size)

    def process_weights_after_loading(self, layer) -> None:
        """The device's int4 layout for codes, scales and offsets together when it has one
        (``ops.prepare_int4_weights``: the cpu ops' VNNI layout), else as every method."""
        if not (hasattr(current_ops(), self.device_op) and self.adopt_device_layout(
                layer, "prepare_int4_weights", ("weight", "weight_scale", "weight_offset"))):
            super().process_weights_after_loading(layer)

    @staticmethod
    def reference_op(x, weight, scale, offset, group_size, bias=None):
        return int4_linear_reference(x, weight, scale, offset, group_size, bias)
