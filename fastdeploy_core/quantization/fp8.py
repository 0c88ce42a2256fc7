"""``block_wise_fp8``: float8_e4m3fn weights with one scale per 128 x 128 block.

Paddle 3.3.1's CPU build has the ``float8_e4m3fn`` dtype and casts to and from it, so the
weights are stored as real 1-byte e4m3 values (largest finite 448). Each block of
``weight_block_size = [128, 128]`` (input rows x output columns) gets ``scale = max|w| / 448``;
blocks are laid out per checkpoint shard, so the Q, K and V (or gate and up) parts of a merged
layer never share a block, and a shard's last block may be narrower. ``weight_scale [Kb, N]``
holds each block's scale repeated over the block's columns, so a kernel reads one scale per
(row block, column). The cpu kernel widens e4m3 to float32 exactly; no matmul runs in fp8.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import paddle
from pydantic import Field, field_validator

from fastdeploy_core.devices.current import current_ops
from fastdeploy_core.quantization.base import QuantizerBase, QuantizerConfig, add_bias, expand_groups
from fastdeploy_core.quantization.codes import num_groups

FP8_E4M3_MAX = 448.0


def fp8_weight(weight: paddle.Tensor, scale: paddle.Tensor, block_rows: int) -> paddle.Tensor:
    """Float32 ``[K, N]`` from e4m3 values ``[K, N]`` and per-block scales ``[Kb, N]``."""
    return weight.astype("float32") * expand_groups(scale, block_rows, int(weight.shape[0]))


def fp8_linear_reference(x, weight, scale, block_rows: int, bias=None) -> paddle.Tensor:
    return add_bias(paddle.matmul(x, fp8_weight(weight, scale, block_rows)), bias)


def quantize_block_fp8(weight: np.ndarray, block: tuple[int, int]) -> dict[str, np.ndarray]:
    """Float ``[K, n]`` -> scaled values (float32, cast to e4m3 on storing) and ``weight_scale [Kb, n]``."""
    rows, cols = weight.shape
    block_rows, block_cols = block
    kb, nb = num_groups(rows, block_rows), num_groups(cols, block_cols)
    padded = np.zeros((kb * block_rows, nb * block_cols), dtype=np.float32)
    padded[:rows, :cols] = np.abs(weight)
    amax = padded.reshape(kb, block_rows, nb, block_cols).max(axis=(1, 3))  # [kb, nb]
    scale = np.where(amax > 0, amax / FP8_E4M3_MAX, 1.0).astype(np.float32)
    per_column = np.repeat(scale, block_cols, axis=1)[:, :cols]  # [kb, n]
    values = weight / np.repeat(per_column, block_rows, axis=0)[:rows]
    return {"weight": np.clip(values, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(np.float32), "weight_scale": per_column}


class BlockWiseFP8Config(QuantizerConfig):
    embedding_quant_type: Literal["wint8"] | None = Field("wint8", description="int8 token embedding (None: float32)")
    lm_head_quant_type: Literal["wint8"] | None = Field("wint8", description="int8 LM head (None: float32)")
    weight_block_size: list[int] = Field(
        default_factory=lambda: [128, 128], description="[input rows, output columns] per scale"
    )

    @field_validator("weight_block_size")
    @classmethod
    def _two_positive(cls, value: list[int]) -> list[int]:
        if len(value) != 2 or min(value) < 1:
            raise ValueError("must be two positive integers [rows, columns]")
        return value


class BlockWiseFP8(QuantizerBase):
    """``block_wise_fp8``: e4m3 weights, 128 x 128 block scales, float32 activations."""

    name = "block_wise_fp8"
    expected_error = 0.05
    config_class = BlockWiseFP8Config
    device_op = "block_wise_fp8_linear"

    @property
    def block(self) -> tuple[int, int]:
        rows, cols = self.config.weight_block_size
        return int(rows), int(cols)

    def storage_shapes(self, input_size: int, output_size: int):
        return {
            "weight": ([input_size, output_size], "float8_e4m3fn"),
            "weight_scale": ([num_groups(input_size, self.block[0]), output_size], "float32"),
        }

    def quantize(self, weight: np.ndarray) -> dict[str, np.ndarray]:
        return quantize_block_fp8(weight, self.block)

    def dequantize(self, layer) -> paddle.Tensor:
        plain = current_ops().unprepare_linear_weight
        return fp8_weight(plain(layer.weight), plain(layer.weight_scale), self.block[0])

    def op_args(self, layer) -> tuple:
        return layer.weight, layer.weight_scale, self.block[0]

    @staticmethod
    def reference_op(x, weight, scale, block_rows, bias=None):
        return fp8_linear_reference(x, weight, scale, block_rows, bias)
