"""GGUF quantized blocks into quantizer storage without a float round trip.

The loader hands a linear weight over as :class:`~fastdeploy_core.loader.gguf_blocks.GGUFBlocks`
when ``quantizer.accepts_gguf(blocks)`` says the storage can hold those blocks as they are;
these functions turn the blocks into that storage. Blocks run along the input axis, 32 values
each:

* ``Q8_0``: float16 ``d`` + 32 int8 ``q``; ``w = d * q`` -> ``wint8`` storage with groups of 32;
* ``Q4_0``: float16 ``d`` + 16 bytes (values 0..15 in the low, 16..31 in the high nibbles);
  ``w = d * (q - 8)`` -> ``wint4`` storage, scale ``d``, offset ``-8 d``;
* ``Q4_1``: float16 ``d``, float16 ``m`` + 16 bytes; ``w = d * q + m`` -> scale ``d``, offset ``m``.

The float16 scales widen to float32 exactly, so the stored model computes with the very
weights llama.cpp does.
"""

from __future__ import annotations

import numpy as np

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.loader.gguf_blocks import GGUFBlocks
from fastdeploy_core.quantization.codes import pack_int4


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
