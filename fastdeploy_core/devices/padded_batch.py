"""Host-side geometry of one step's ragged batch, padded for attention backends.

Every attention backend that pads queries to ``[B, max_q]`` and gathers whole KV blocks to
``[B, max_kv]`` needs the same index math; it lives here once and each backend turns it into
the tensors (and mask shape) it wants.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PaddedBatch:
    """Sizes and host arrays of one step (numpy, int64)."""

    seq_lens: np.ndarray  # [B]
    query_start: np.ndarray  # [B + 1]
    query_lens: np.ndarray  # [B]
    context_lens: np.ndarray  # [B]
    block_table: np.ndarray  # [B, num_blocks]: just the blocks the longest sequence needs
    batch: int
    max_q: int
    max_kv: int

    @classmethod
    def from_meta(cls, meta, block_size: int) -> "PaddedBatch":
        seq_lens = np.asarray(meta.seq_lens, dtype=np.int64)
        query_start = np.asarray(meta.query_start_loc, dtype=np.int64)
        query_lens = np.diff(query_start)
        num_blocks = -(-int(seq_lens.max()) // block_size)
        table = np.asarray(meta.block_tables, dtype=np.int64)
        if table.shape[1] < num_blocks:
            raise ValueError(
                f"block_tables has {table.shape[1]} columns but a sequence of {int(seq_lens.max())} tokens "
                f"needs {num_blocks} blocks of {block_size}"
            )
        return cls(
            seq_lens=seq_lens,
            query_start=query_start,
            query_lens=query_lens,
            context_lens=seq_lens - query_lens,
            block_table=table[:, :num_blocks],
            batch=int(seq_lens.shape[0]),
            max_q=int(query_lens.max()),
            max_kv=num_blocks * block_size,
        )

    def visible(self, sliding_window: int | None = None) -> np.ndarray:
        """``[B, max_q, max_kv]``: key ``j`` is visible to padded query ``i`` (causal, within length,
        and with a sliding window ``w`` only the last ``w`` positions: ``j > i - w``, as HF's Mistral)."""
        kv_pos = np.arange(self.max_kv, dtype=np.int64)
        q_pos = self.context_lens[:, None] + np.arange(self.max_q, dtype=np.int64)[None, :]
        seen = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < self.seq_lens[:, None, None])
        if sliding_window:
            seen &= kv_pos[None, None, :] > q_pos[:, :, None] - int(sliding_window)
        return seen

    def pad_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(token row of each padded query slot, flattened ``[B * max_q]`` with padding -> 0;
        the padded slots that are real queries, in token order)."""
        q_offset = np.arange(self.max_q, dtype=np.int64)
        real = q_offset[None, :] < self.query_lens[:, None]
        rows = np.where(real, self.query_start[:-1, None] + q_offset[None, :], 0)
        return rows.reshape(-1), np.nonzero(real.reshape(-1))[0].astype(np.int64)
