"""GGUF quantized tensors into quantizer storage without a float round trip.

A GGUF loader that knows the active quantizer hands a linear weight over as
:class:`GGUFBlocks` (raw block bytes, HF orientation ``[out, in]``) instead of dequantizing
it, when ``quantizer.accepts_gguf(blocks)`` says the storage can hold those blocks as they
are. GGUF blocks run along the input axis, 32 values each:

* ``Q8_0``: float16 ``d`` + 32 int8 ``q``; ``w = d * q`` -> ``wint8`` storage with groups of 32;
* ``Q4_0``: float16 ``d`` + 16 bytes (values 0..15 in the low, 16..31 in the high nibbles);
  ``w = d * (q - 8)`` -> ``wint4`` storage, scale ``d``, offset ``-8 d``;
* ``Q4_1``: float16 ``d``, float16 ``m`` + 16 bytes; ``w = d * q + m`` -> scale ``d``, offset ``m``.

The float16 scales widen to float32 exactly, so the stored model computes with the very
weights llama.cpp does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.quantization.codes import pack_int4

BLOCK = 32
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


@dataclass
class GGUFBlocks:
    """One GGUF tensor's raw blocks: ``data uint8 [out, in / 32 * block_bytes]``, ``shape (out, in)``."""

    type_name: str
    data: np.ndarray
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if self.type_name not in _BLOCK_BYTES:
            raise ModelLoadError(f"GGUF block type {self.type_name} cannot be taken directly; dequantize it instead")
        out, inp = self.shape
        if inp % BLOCK:
            raise ModelLoadError(f"GGUF tensor of shape {self.shape}: the input size is not a multiple of {BLOCK}")
        row_bytes = inp // BLOCK * _BLOCK_BYTES[self.type_name]
        data = np.ascontiguousarray(self.data, dtype=np.uint8)
        if data.size != out * row_bytes:
            raise ModelLoadError(
                f"GGUF {self.type_name} tensor of shape {self.shape} holds {data.size} bytes, expected {out * row_bytes}"
            )
        self.data = data.reshape(out, row_bytes)

    def blocks(self) -> np.ndarray:
        """``[out, in / 32, block_bytes]`` view of the raw data."""
        out, inp = self.shape
        return self.data.reshape(out, inp // BLOCK, _BLOCK_BYTES[self.type_name])

    def permute_rows(self, order: np.ndarray) -> GGUFBlocks:
        """The same tensor with its output rows reordered (e.g. undoing llama.cpp's Q/K row permutation)."""
        return GGUFBlocks(self.type_name, self.data[order], self.shape)

    def unpermute_heads(self, num_heads: int) -> GGUFBlocks:
        """Undo llama.cpp's interleaved-RoPE row order of attn_q / attn_k (rows are whole blocks)."""
        rows = self.shape[0]
        head_dim = rows // num_heads
        order = np.arange(rows).reshape(num_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)
        return self.permute_rows(order)

    def dequantize(self) -> np.ndarray:
        """Float32 ``[out, in]`` (through gguf-py), for storage that cannot hold the blocks."""
        from gguf import GGMLQuantizationType, quants

        values = quants.dequantize(self.data, GGMLQuantizationType[self.type_name])
        return np.asarray(values, dtype=np.float32).reshape(self.shape)


#: GGUF tensor-name parts of the linear layers (attention and MLP projections).
LINEAR_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def linear_tensor_types(path: str) -> set[str]:
    """GGUF types (``"Q4_1"``, ``"F32"``...) of the linear-layer weights in the GGUF file ``path``."""
    from fastdeploy_core.loader.gguf_loader import open_gguf

    types = set()
    for tensor in open_gguf(path).tensors:
        parts = tensor.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in LINEAR_PARTS and parts[3] == "weight":
            types.add(tensor.tensor_type.name)
    return types


def _half(raw: np.ndarray) -> np.ndarray:
    """Two bytes per entry (last axis) as float16 -> float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def q8_0_to_int8(blocks: GGUFBlocks) -> dict[str, np.ndarray]:
    """Q8_0 -> ``{"weight": int8 [in, out], "weight_scale": float32 [in / 32, out]}``."""
    if blocks.type_name != "Q8_0":
        raise ModelLoadError(f"expected Q8_0 blocks, got {blocks.type_name}")
    raw = blocks.blocks()
    out, inp = blocks.shape
    scale = _half(raw[:, :, 0:2])  # [out, nb]
    codes = np.ascontiguousarray(raw[:, :, 2:]).view(np.int8).reshape(out, inp)
    return {"weight": np.ascontiguousarray(codes.T), "weight_scale": np.ascontiguousarray(scale.T)}


def q4_to_int4(blocks: GGUFBlocks) -> dict[str, np.ndarray]:
    """Q4_0 / Q4_1 -> packed ``wint4`` storage with groups of 32 (``weight``, ``weight_scale``, ``weight_offset``)."""
    raw = blocks.blocks()
    out, inp = blocks.shape
    scale = _half(raw[:, :, 0:2])
    if blocks.type_name == "Q4_1":
        offset = _half(raw[:, :, 2:4])
        nibbles = raw[:, :, 4:]
    elif blocks.type_name == "Q4_0":
        offset = -8.0 * scale
        nibbles = raw[:, :, 2:]
    else:
        raise ModelLoadError(f"expected Q4_0 or Q4_1 blocks, got {blocks.type_name}")
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=2).reshape(out, inp)  # block order: low then high
    return {
        "weight": pack_int4(codes.T),
        "weight_scale": np.ascontiguousarray(scale.T),
        "weight_offset": np.ascontiguousarray(offset.T.astype(np.float32)),
    }
