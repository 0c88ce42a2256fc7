"""The cpu device's packed weight layouts: how its kernels want linear weights laid out in memory.

A loaded linear weight (float32 ``[in, out]``, or a quantizer's int8 / int4 / fp8 storage
``[rows, out]``) is repacked as ``[out / 32, rows, 32]`` column tiles (:func:`pack_column_tiles`):
each 32-column tile is one contiguous stream the hardware prefetcher follows, where the rows of
a row-major ``[in, out]`` weight are 128-byte pieces ``4 * out`` bytes apart. int4 codes on a
CPU with AVX-512 VNNI take :func:`pack_int4_vnni_tiles` instead; the stacked float32 experts of
a mixture-of-experts layer take one such layout per expert (:func:`pack_expert_tiles`); bfloat16
weights (``--dtype bfloat16``) take pairs of consecutive k per column (:func:`pack_bf16_pair_tiles`),
``w8a8`` codes quads of them (:func:`pack_int8_quad_tiles`).
:func:`unpack_column_tiles` is the inverse of all of them: what :meth:`CpuOps.unprepare_linear_weight` hands the device-neutral
reference formulas of the quantizers.
"""

from __future__ import annotations

import numpy as np
import paddle

#: Columns per tile of the packed weight layout (``kCols`` in ``csrc/weight_only_gemm.cc``).
PACK_COLUMNS = 32


def pack_column_tiles(weight: paddle.Tensor) -> paddle.Tensor:
    """``[rows, N]`` -> ``[N / 32, rows, 32]``: each 32-column tile one contiguous block (any dtype)."""
    rows, cols = (int(n) for n in weight.shape)
    return weight.reshape([rows, cols // PACK_COLUMNS, PACK_COLUMNS]).transpose([1, 0, 2]).contiguous()


#: k (input rows) per 4-byte lane of the int4 VNNI layout (``kVnniChunk`` in the C++ kernel).
VNNI_CHUNK = 8


def pack_int4_vnni_tiles(weight: paddle.Tensor) -> paddle.Tensor:
    """int4 storage ``uint8 [K / 2, N]`` -> ``uint8 [N / 32, K / 8, 32, 4]`` (the VNNI int4 kernel's layout).

    Byte ``[t, c, n, j]`` holds code ``q[8 c + j, 32 t + n]`` in its low and ``q[8 c + 4 + j, 32 t + n]``
    in its high nibble: each 32-bit lane of a 64-byte load is one column's 4 consecutive k, as
    ``vpdpbusd`` multiplies them. Needs ``K % 8 == 0`` and ``N % 32 == 0``.
    """
    half, cols = (int(n) for n in weight.shape)
    rows = 2 * half
    if rows % VNNI_CHUNK or cols % PACK_COLUMNS:
        raise ValueError(f"the int4 VNNI layout needs K % 8 == 0 and N % 32 == 0, got K={rows}, N={cols}")
    packed = weight.numpy()
    codes = np.empty((rows, cols), dtype=np.uint8)
    codes[0::2] = packed & 15
    codes[1::2] = packed >> 4
    # [K/8, 8, N/32, 32] -> [N/32, K/8, 32, 8]
    tiles = codes.reshape(rows // VNNI_CHUNK, VNNI_CHUNK, cols // PACK_COLUMNS, PACK_COLUMNS).transpose(2, 0, 3, 1)
    out = tiles[..., :4] | (tiles[..., 4:] << 4)
    return paddle.to_tensor(np.ascontiguousarray(out, dtype=np.uint8))


def unpack_int4_vnni_tiles(weight: paddle.Tensor) -> paddle.Tensor:
    """Inverse of :func:`pack_int4_vnni_tiles`: ``uint8 [K / 2, N]`` (plain Paddle ops)."""
    tiles, chunks, cols, _ = (int(n) for n in weight.shape)
    wide = weight.astype("int32")
    low = paddle.bitwise_and(wide, paddle.full([], 15, dtype="int32"))
    high = paddle.bitwise_right_shift(wide, paddle.full([], 4, dtype="int32"))
    codes = paddle.concat([low, high], axis=3)  # [T, C, 32, 8]: k = 8 c + index
    codes = codes.transpose([1, 3, 0, 2]).reshape([chunks * VNNI_CHUNK // 2, 2, tiles * cols])
    even, odd = codes[:, 0], codes[:, 1]
    return paddle.bitwise_or(even, paddle.bitwise_left_shift(odd, paddle.full([], 4, dtype="int32"))).astype("uint8")


#: k (input rows) per 4-byte lane of the int8 quad layout (``kQuad`` in ``csrc/w8a8_gemm.cc``).
QUAD_ROWS = 4


def pack_int8_quad_tiles(weight: paddle.Tensor) -> paddle.Tensor:
    """int8 codes ``[K, N]`` -> ``int8 [N / 32, K / 4, 32, 4]`` (``fd_w8a8_linear``'s layout).

    Element ``[t, c, n, j]`` is ``q[4 c + j, 32 t + n]``: each 32-bit lane of a 64-byte load is one
    column's 4 consecutive k, as ``vpdpbusd`` multiplies them. Needs ``K % 4 == 0`` and ``N % 32 == 0``.
    """
    rows, cols = (int(n) for n in weight.shape)
    if rows % QUAD_ROWS or cols % PACK_COLUMNS:
        raise ValueError(f"the int8 quad layout needs K % 4 == 0 and N % 32 == 0, got K={rows}, N={cols}")
    tiles = weight.reshape([rows // QUAD_ROWS, QUAD_ROWS, cols // PACK_COLUMNS, PACK_COLUMNS])  # [c, j, t, n]
    return tiles.transpose([2, 0, 3, 1]).contiguous()


def unpack_int8_quad_tiles(weight: paddle.Tensor) -> paddle.Tensor:
    """Inverse of :func:`pack_int8_quad_tiles`: int8 ``[K, N]``."""
    tiles, quads, cols, _ = (int(n) for n in weight.shape)
    return weight.transpose([1, 3, 0, 2]).reshape([QUAD_ROWS * quads, tiles * cols])


def pack_expert_tiles(weight: paddle.Tensor) -> paddle.Tensor:
    """Stacked float32 experts ``[E, rows, N]`` -> ``[E, N / 32, rows, 32]``: each expert's weight
    in :func:`pack_column_tiles`' layout (what ``fd_fused_moe`` reads with ``fd_f32_linear``'s loop)."""
    experts, rows, cols = (int(n) for n in weight.shape)
    return weight.reshape([experts, rows, cols // PACK_COLUMNS, PACK_COLUMNS]).transpose([0, 2, 1, 3]).contiguous()


def unpack_expert_tiles(weight: paddle.Tensor) -> paddle.Tensor:
    """Inverse of :func:`pack_expert_tiles`: ``[E, rows, N]``."""
    experts, tiles, rows, cols = (int(n) for n in weight.shape)
    return weight.transpose([0, 2, 1, 3]).reshape([experts, rows, tiles * cols])


def pack_bf16_pair_tiles(weight: paddle.Tensor) -> paddle.Tensor:
    """bfloat16 ``[K, N]`` -> ``[N / 32, K / 2, 32, 2]`` (``fd_bf16_linear``'s layout).

    Element ``[t, j, c, e]`` is ``W[2 j + e, 32 t + c]``: each 32-bit lane of a 64-byte load is
    one column's two consecutive k, as ``vdpbf16ps`` multiplies them, and a tile's columns are
    one contiguous stream. Needs ``K % 2 == 0`` and ``N % 32 == 0``.
    """
    rows, cols = (int(n) for n in weight.shape)
    if cols % PACK_COLUMNS or rows % 2:
        raise ValueError(f"the bfloat16 pair layout needs K % 2 == 0 and N % 32 == 0, got K={rows}, N={cols}")
    tiles = weight.reshape([rows // 2, 2, cols // PACK_COLUMNS, PACK_COLUMNS])  # [j, e, t, c]
    return tiles.transpose([2, 0, 3, 1]).contiguous()


def unpack_bf16_pair_tiles(weight: paddle.Tensor) -> paddle.Tensor:
    """Inverse of :func:`pack_bf16_pair_tiles`: bfloat16 ``[K, N]``."""
    tiles, pairs, cols, _ = (int(n) for n in weight.shape)
    return weight.transpose([1, 3, 0, 2]).reshape([2 * pairs, tiles * cols])


def unpack_column_tiles(weight: paddle.Tensor) -> paddle.Tensor:
    """The plain storage of a weight: ``[rows, N]`` whether packed by :func:`pack_column_tiles`,
    by :func:`pack_int4_vnni_tiles` (uint8, rank 4), by :func:`pack_bf16_pair_tiles` (bfloat16,
    rank 4), by :func:`pack_int8_quad_tiles` (int8, rank 4) or not packed; ``[E, rows, N]`` for float32 experts packed by :func:`pack_expert_tiles`
    (rank 4)."""
    if weight.ndim == 4:
        if weight.dtype == paddle.bfloat16:
            return unpack_bf16_pair_tiles(weight)
        if weight.dtype == paddle.int8:
            return unpack_int8_quad_tiles(weight)
        return unpack_expert_tiles(weight) if weight.dtype == paddle.float32 else unpack_int4_vnni_tiles(weight)
    if weight.ndim != 3:
        return weight
    tiles, rows, cols = (int(n) for n in weight.shape)
    return weight.transpose([1, 0, 2]).reshape([rows, tiles * cols])
