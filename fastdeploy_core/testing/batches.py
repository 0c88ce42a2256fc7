"""Hand-built ragged batches for the conformance kit: ForwardMeta without an engine.

Each sequence owns a block table; a step hands some new tokens of every sequence to the model
in one flattened batch, exactly the layout the engine's model runner produces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle

from fastdeploy_core.executor.forward_meta import ForwardMeta


def build_meta(chunks: list[tuple[list[int], int, list[int]]], block_size: int) -> ForwardMeta:
    """``chunks``: per sequence ``(new_token_ids, context_len, block_table)`` -> ForwardMeta.

    ``context_len`` tokens of the sequence are already in the cache (prefix-cached or computed
    earlier); the new tokens sit at positions ``context_len ...``.
    """
    ids, positions, slots, query_start, seq_lens = [], [], [], [0], []
    width = max(len(table) for _, _, table in chunks)
    tables = np.zeros((len(chunks), width), dtype=np.int64)
    for b, (new_ids, context_len, table) in enumerate(chunks):
        for i, token in enumerate(new_ids):
            pos = context_len + i
            ids.append(token)
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_start.append(query_start[-1] + len(new_ids))
        seq_lens.append(context_len + len(new_ids))
        tables[b, : len(table)] = table
    query_start_loc = np.asarray(query_start, dtype=np.int64)
    return ForwardMeta(
        input_ids=paddle.to_tensor(np.asarray(ids, dtype=np.int64)),
        positions=paddle.to_tensor(np.asarray(positions, dtype=np.int64)),
        slot_mapping=paddle.to_tensor(np.asarray(slots, dtype=np.int64)),
        query_start_loc=query_start_loc,
        seq_lens=np.asarray(seq_lens, dtype=np.int64),
        block_tables=tables,
        block_size=block_size,
        logits_indices=paddle.to_tensor(query_start_loc[1:] - 1),
    )


@dataclass
class BlockPool:
    """Hands out block ids in a scrambled order, so tests see non-contiguous block tables."""

    num_blocks: int
    seed: int = 0
    _free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        order = np.random.default_rng(self.seed).permutation(np.arange(1, self.num_blocks))
        self._free = [int(b) for b in order]  # block 0 is kept as padding, never handed out

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"block pool exhausted: asked {n}, {len(self._free)} left of {self.num_blocks}")
        taken, self._free = self._free[:n], self._free[n:]
        return taken


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
