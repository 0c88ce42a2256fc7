"""Integer codes of quantized weights, in numpy: grouping, online quantization, int4 packing.

The device-neutral arithmetic every quantizer and the GGUF block conversions share. It imports
no other module of the package, so quantizers, the int8 embedding and the GGUF conversions
all build on it without importing one another.
"""

from __future__ import annotations

import numpy as np


def num_groups(rows: int, group_size: int) -> int:
    return -(-rows // group_size)


def grouped_abs_max(weight: np.ndarray, group_size: int) -> np.ndarray:
    """``max |w|`` over each group of rows of ``weight [K, n]`` -> ``[G, n]``."""
    rows = weight.shape[0]
    groups = num_groups(rows, group_size)
    pad = groups * group_size - rows
    padded = np.pad(np.abs(weight), ((0, pad), (0, 0))) if pad else np.abs(weight)
    return padded.reshape(groups, group_size, -1).max(axis=1)


def repeat_rows(per_group: np.ndarray, group_size: int, rows: int) -> np.ndarray:
    """Per-group rows ``[G, n]`` -> per-row ``[rows, n]`` (numpy twin of ``base.expand_groups``)."""
    return np.repeat(per_group, group_size, axis=0)[:rows]


def quantize_int8(weight: np.ndarray, group_size: int) -> dict[str, np.ndarray]:
    """Float ``[K, n]`` -> ``{"weight": int8 [K, n], "weight_scale": [G, n]}`` (symmetric, round to nearest)."""
    rows = weight.shape[0]
    scale = grouped_abs_max(weight, group_size) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    codes = np.clip(np.rint(weight / repeat_rows(scale, group_size, rows)), -127, 127).astype(np.int8)
    return {"weight": codes, "weight_scale": scale}


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """Codes ``[K, n]`` in [0, 15] -> ``uint8 [K / 2, n]`` (even rows low nibble, odd rows high)."""
    codes = codes.astype(np.uint8)
    return (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)


def quantize_int4(weight: np.ndarray, group_size: int, has_zero_point: bool) -> dict[str, np.ndarray]:
    """Float ``[K, n]`` -> packed codes, ``weight_scale`` and ``weight_offset [G, n]``."""
    rows = weight.shape[0]
    groups = num_groups(rows, group_size)
    pad = groups * group_size - rows
    if has_zero_point:
        padded = np.pad(weight, ((0, pad), (0, 0)), mode="edge") if pad else weight
        blocks = padded.reshape(groups, group_size, -1)
        low, high = blocks.min(axis=1), blocks.max(axis=1)
        scale = (high - low) / 15.0
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        offset = low.astype(np.float32)
    else:
        scale = grouped_abs_max(weight, group_size) / 7.0
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        offset = (-8.0 * scale).astype(np.float32)
    codes = np.rint((weight - repeat_rows(offset, group_size, rows)) / repeat_rows(scale, group_size, rows))
    codes = np.clip(codes, 0, 15)
    return {"weight": pack_int4(codes), "weight_scale": scale, "weight_offset": offset}


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values -> their bfloat16 bit patterns (``uint16``, which Paddle takes as bfloat16):
    round to nearest, ties to even, as Paddle's ``astype("bfloat16")``; NaN stays a (quiet) NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return rounded
