"""What one engine step hands to the model: the ragged batch, flattened.

All scheduled tokens of all requests are concatenated into ``T`` rows. Host-side arrays
(numpy) describe the ragged structure; the attention backend turns them into device tensors
once per step (cached in :attr:`ForwardMeta.attn_state`) and every layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class ForwardMeta:
    """The flattened batch of one step.

    Row ``t`` of the batch belongs to sequence ``b`` where
    ``query_start_loc[b] <= t < query_start_loc[b + 1]``. Sequence ``b`` already holds
    ``seq_lens[b] - query_lens[b]`` tokens in the KV cache (prefix-cached or computed in
    earlier steps); this step adds its ``query_lens[b]`` new tokens at positions
    ``seq_lens[b] - query_lens[b] ... seq_lens[b] - 1``.
    """

    input_ids: Any  # paddle.Tensor [T] int64
    positions: Any  # paddle.Tensor [T] int64
    slot_mapping: Any  # paddle.Tensor [T] int64: block_id * block_size + offset of each new token
    query_start_loc: np.ndarray  # [B + 1] int64, host
    seq_lens: np.ndarray  # [B] int64, host: cached + new tokens after this step
    block_tables: np.ndarray  # [B, max_blocks] int64, host, padded with 0
    block_size: int
    logits_indices: Any  # paddle.Tensor [B] int64: row of each sequence's last new token
    #: Scratch for the attention backend: derived tensors built once per step.
    attn_state: dict = field(default_factory=dict)
    #: Device int64 copies of the host arrays, by field name (see :meth:`tensor`); a captured
    #: decode graph's meta holds static ones that the runner refreshes in place.
    tensors: dict = field(default_factory=dict)
    #: Called with a decoder layer's index once that layer's KV cache rows of this step are
    #: written (eager forwards of models built on ``layers/decoder.py``; None otherwise). A
    #: prefill instance sends each layer's KV blocks from here while the next layers compute.
    after_layer: Any = None

    def tensor(self, name: str):
        """``query_start_loc``, ``seq_lens`` or ``block_tables`` as an int64 paddle tensor, made
        once per step and shared by every layer."""
        t = self.tensors.get(name)
        if t is None:
            import paddle

            t = self.tensors[name] = paddle.to_tensor(np.ascontiguousarray(getattr(self, name), dtype=np.int64))
        return t

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    @property
    def context_lens(self) -> np.ndarray:
        """Tokens already in the KV cache before this step, per sequence."""
        return self.seq_lens - self.query_lens

    @property
    def is_decode_only(self) -> bool:
        return bool(np.all(self.query_lens == 1))
