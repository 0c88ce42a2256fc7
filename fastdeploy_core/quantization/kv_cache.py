"""KV cache int8 (``kv_cache_quant_type: "int8"``): quantize on write, dequantize on read.

Each layer's K and V caches (or its one latent cache, for multi-head latent attention) become
:class:`QuantizedKVCache`: int8 codes
``[num_blocks, block_size, kv_heads, head_dim]`` plus one float32 scale per cached token and
head (``[num_blocks, block_size, kv_heads, 1]``, ``|x|max / 127`` of that head's vector), so a
token costs ``head_dim + 4`` bytes per head instead of ``4 * head_dim``. Scales are computed
when a token is written (no calibration data needed) and never change afterwards, so prefix
caching and preemption keep working on the quantized blocks.

:class:`Int8KVCacheOps` wraps any device's ops table: ``write_kv_cache`` quantizes the step's
K/V into the slots; ``paged_attention`` dequantizes only the blocks the step's sequences use
(gathered once per step and layer) into a compact float cache, renumbers the block tables to
it, and runs the wrapped table's own attention on that, so every attention backend gets the
int8 cache for free; ``mla_paged_attention`` does the same with the latent rows (``L + dr``
codes and a scale for the latent and one for the rotary key per token: ``L + dr + 8`` bytes
instead of ``4 (L + dr)``).
"""

from __future__ import annotations

import copy

import numpy as np
import paddle

from fastdeploy_core.devices.reference_ops import ReferenceOps


def quantize_kv(x: paddle.Tensor, parts: tuple[int, ...] = ()) -> tuple[paddle.Tensor, paddle.Tensor]:
    """``x [..., d]`` -> int8 codes ``[..., d]`` and float32 scales ``[..., P]``: one per vector,
    or one per part when ``parts`` splits ``d`` (e.g. a latent and a rotary key, whose ranges differ)."""
    if parts:
        pieces = [quantize_kv(piece) for piece in paddle.split(x, list(parts), axis=-1)]
        return paddle.concat([c for c, _ in pieces], axis=-1), paddle.concat([s for _, s in pieces], axis=-1)
    amax = paddle.max(paddle.abs(x), axis=-1, keepdim=True)
    scale = paddle.where(amax > 0, amax / 127.0, paddle.ones_like(amax))
    codes = paddle.clip(paddle.round(x / scale), -127.0, 127.0).astype("int8")
    return codes, scale


def dequantize_kv(codes: paddle.Tensor, scale: paddle.Tensor, parts: tuple[int, ...] = ()) -> paddle.Tensor:
    if parts:
        scale = paddle.repeat_interleave(scale, paddle.to_tensor(list(parts), dtype="int64"), axis=-1)
    return codes.astype("float32") * scale


class QuantizedKVCache:
    """One layer's K (or V) paged cache in int8 with per-token, per-head scales."""

    def __init__(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, zeros=None, parts: tuple[int, ...] = ()
    ):
        """``zeros(shape, dtype)`` allocates the buffers (the device's ``Device.zeros``); ``parts``
        splits each vector into separately scaled parts (one scale per vector without it)."""
        zeros = zeros or (lambda shape, dtype: paddle.zeros(shape, dtype=dtype))
        self.parts = tuple(parts)
        self.data = zeros([num_blocks, block_size, num_kv_heads, head_dim], "int8")
        self.scale = zeros([num_blocks, block_size, num_kv_heads, max(1, len(self.parts))], "float32")

    @property
    def shape(self) -> list[int]:
        return list(self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.data.shape)) + 4 * int(np.prod(self.scale.shape))

    def index_put_(self, indices: tuple, values: paddle.Tensor) -> QuantizedKVCache:
        """Quantize ``values [T, kvh, d]`` and store them at ``indices = (block_ids, offsets)``.

        Same call as ``paddle.Tensor.index_put_``, so a write path written for float caches works unchanged.
        """
        return self.store(indices, *quantize_kv(values, self.parts))

    def store(self, indices: tuple, codes: paddle.Tensor, scale: paddle.Tensor) -> QuantizedKVCache:
        """Put already quantized rows (``quantize_kv(values, self.parts)``) at ``indices``."""
        self.data.index_put_(indices, codes)
        self.scale.index_put_(indices, scale)
        return self

    def gather_blocks(self, block_ids: paddle.Tensor) -> paddle.Tensor:
        """Float32 ``[n, block_size, kvh, d]`` of the blocks ``block_ids``."""
        codes = paddle.gather(self.data, block_ids, axis=0)  # index_select has no int8 kernel on cpu
        scale = paddle.gather(self.scale, block_ids, axis=0)
        return dequantize_kv(codes, scale, self.parts)

    def dequantize(self) -> paddle.Tensor:
        """The whole cache in float32 (tests)."""
        return dequantize_kv(self.data, self.scale, self.parts)


class Int8KVCacheQuantizer:
    """``kv_cache_quant_type: int8``: allocates :class:`QuantizedKVCache` pairs and wraps the ops table."""

    name = "int8"

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one token of K or V in one layer."""
        return num_kv_heads * (head_dim + 4)

    def layout_bytes_per_token(self, layout) -> int:
        """Bytes one token takes in one layer of ``layout`` (a ``KVCacheLayout``): codes plus a
        scale per head (and per part) of each of its tensors (K and V, or the one latent row)."""
        scales = max(1, len(layout.parts))
        return sum(heads * (dim + 4 * scales) for heads, dim in layout.token_shapes)

    def allocate_layout(self, layout, num_blocks: int, block_size: int, zeros=None) -> list[tuple]:
        """Per layer of ``layout``, one :class:`QuantizedKVCache` per tensor it declares."""
        return [
            tuple(QuantizedKVCache(num_blocks, block_size, heads, dim, zeros, layout.parts)
                  for heads, dim in layout.token_shapes)
            for _ in range(layout.num_layers)
        ]

    def wrap_ops(self, ops) -> Int8KVCacheOps:
        return Int8KVCacheOps(ops)


class Int8KVCacheOps:
    """An ops table whose KV caches are :class:`QuantizedKVCache`; every other op is the wrapped table's."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    # The composed form, bound to this table so it writes and reads the int8 caches (the
    # wrapped table's fused version expects float caches).
    rope_paged_attention = ReferenceOps.rope_paged_attention
    ragged_attention = False  # the composition pads like the reference (the wrapped table's answer is not ours)

    def write_kv_cache(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        block_size = k_cache.shape[1]
        block_ids = paddle.floor_divide(slot_mapping, paddle.to_tensor(block_size, dtype=slot_mapping.dtype))
        offsets = slot_mapping - block_ids * block_size
        k_cache.index_put_((block_ids, offsets), k)
        v_cache.index_put_((block_ids, offsets), v)

    def paged_attention(self, q, k_cache, v_cache, meta, scale: float, sliding_window: int | None = None):
        if not isinstance(k_cache, QuantizedKVCache):
            return self.inner.paged_attention(q, k_cache, v_cache, meta, scale, sliding_window)
        compact = meta.attn_state.get("int8_kv")
        if compact is None:
            compact = self._compact_meta(meta, k_cache.shape[1])
            meta.attn_state["int8_kv"] = compact
        used, compact_meta = compact
        k_float = k_cache.gather_blocks(used)
        v_float = v_cache.gather_blocks(used)
        return self.inner.paged_attention(q, k_float, v_float, compact_meta, scale, sliding_window)

    def mla_paged_attention(self, q, latent, latent_cache, meta, w_kv, scale: float, form: str = "auto"):
        """The latent row of each new token is stored as int8 (one scale per token); the step's
        blocks are dequantized into a compact float cache, the wrapped table's own MLA op runs
        on it, and the new rows it writes there are their dequantized values, so this step
        reads exactly what later steps (and prefix-cache hits) will."""
        if not isinstance(latent_cache, QuantizedKVCache):
            return self.inner.mla_paged_attention(q, latent, latent_cache, meta, w_kv, scale, form)
        step = meta.attn_state.get("int8_latent")  # the same for every layer of the step
        if step is None:
            block_size = latent_cache.shape[1]
            block_ids = paddle.floor_divide(meta.slot_mapping, paddle.to_tensor(block_size, dtype=meta.slot_mapping.dtype))
            used, compact_meta = self._compact_meta(meta, block_size)
            compact_meta.slot_mapping = self._compact_slots(meta.slot_mapping, used, block_size)
            step = ((block_ids, meta.slot_mapping - block_ids * block_size), used, compact_meta)
            meta.attn_state["int8_latent"] = step
        indices, used, compact_meta = step
        parts = latent_cache.parts
        codes, scales = quantize_kv(latent.reshape([-1, 1, int(latent.shape[-1])]), parts)
        latent_cache.store(indices, codes, scales)
        stored = dequantize_kv(codes, scales, parts).reshape(latent.shape)
        return self.inner.mla_paged_attention(q, stored, latent_cache.gather_blocks(used), compact_meta, w_kv, scale, form)

    @staticmethod
    def _compact_slots(slot_mapping, used: paddle.Tensor, block_size: int) -> paddle.Tensor:
        """``slot_mapping`` renumbered to the compact cache of the blocks ``used`` (sorted ids)."""
        slots = np.asarray(slot_mapping.numpy() if isinstance(slot_mapping, paddle.Tensor) else slot_mapping)
        index = np.searchsorted(used.numpy(), slots // block_size)
        return paddle.to_tensor((index * block_size + slots % block_size).astype(np.int64))

    @staticmethod
    def _compact_meta(meta, block_size: int):
        """The blocks the step reads (numbered 0..n-1) and a copy of ``meta`` whose block tables use those numbers."""
        seq_lens = np.asarray(meta.seq_lens, dtype=np.int64)
        tables = np.asarray(meta.block_tables, dtype=np.int64)
        needed = -(-seq_lens // block_size)
        width = int(needed.max()) if needed.size else 0
        tables = tables[:, :width]
        valid = np.arange(width)[None, :] < needed[:, None]
        used, inverse = np.unique(np.where(valid, tables, tables[valid][0] if valid.any() else 0), return_inverse=True)
        remapped = inverse.reshape(tables.shape).astype(np.int64)
        compact_meta = copy.copy(meta)
        compact_meta.block_tables = remapped
        compact_meta.attn_state = {}
        return paddle.to_tensor(used.astype(np.int64)), compact_meta
