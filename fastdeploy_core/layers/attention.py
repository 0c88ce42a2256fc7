"""Paged attention layer: store this step's K/V in the paged cache, then attend over it."""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy_core.devices.current import current_ops


class Attention(nn.Layer):
    """Multi-head / grouped-query attention over a paged KV cache.

    ``forward(q [T, h, d], k [T, kvh, d], v [T, kvh, d], kv_cache, meta) -> [T, h, d]``.
    ``kv_cache`` is this layer's ``(k_cache, v_cache)``, each
    ``[num_blocks, block_size, kvh, d]``; new K/V are written at ``meta.slot_mapping``.
    """

    def __init__(
        self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float | None = None, sliding_window: int | None = None
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = float(scale) if scale is not None else head_dim**-0.5
        #: Attend only to the last ``sliding_window`` positions (Mistral v0.1); ``None``: all.
        self.sliding_window = int(sliding_window) if sliding_window else None

    def forward(self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, kv_cache, meta) -> paddle.Tensor:
        ops = current_ops()
        k_cache, v_cache = kv_cache
        ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return ops.paged_attention(q, k_cache, v_cache, meta, self.scale, self.sliding_window)

    def forward_qkv(self, qkv: paddle.Tensor, positions: paddle.Tensor, rotary, kv_cache, meta) -> paddle.Tensor:
        """From a fused QKV projection ``[T, (h + 2 kvh) * d]``: rotary embedding of Q and K by
        ``rotary`` (a :class:`~fastdeploy_core.layers.rotary.RotaryEmbedding`), KV write and
        attention, as the device's one ``rope_paged_attention`` op. Returns ``[T, h * d]``."""
        k_cache, v_cache = kv_cache
        return current_ops().rope_paged_attention(
            qkv,
            positions,
            rotary.cos_sin_cache,
            k_cache,
            v_cache,
            meta,
            self.num_heads,
            self.num_kv_heads,
            self.scale,
            self.sliding_window,
        )
