"""A tiny hand-built model driver for the model tests: ForwardMeta by hand, paged KV caches.

It stands in for the engine's model runner so the numerics can be tested on their own:
each sequence owns a block table; every step flattens the scheduled tokens of all
sequences into one ragged batch, exactly as the runner does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle

from fastdeploy_core.layers.kv_layout import kv_cache_layout
from fastdeploy_core.testing.batches import build_meta  # shared with the conformance kit


@dataclass
class SeqState:
    """One sequence: its tokens so far, how many are in the KV cache, its blocks."""

    tokens: list[int]
    block_table: list[int]
    num_computed: int = 0
    generated: list[int] = field(default_factory=list)


class PagedHarness:
    """Owns the per-layer caches of one model and runs steps over hand-made batches."""

    def __init__(self, model, num_blocks: int, block_size: int):
        self.model = model
        self.block_size = block_size
        # The layout the model declares, as the runner allocates it (K/V per head, or a latent row).
        self.kv_caches = kv_cache_layout(model).allocate(
            num_blocks, block_size, lambda shape, dtype: paddle.zeros(shape, dtype)
        )

    def step(self, chunks: list[tuple[list[int], int, list[int]]]) -> np.ndarray:
        """Run one step; returns float32 logits ``[B, V]`` of each sequence's last new token."""
        meta = build_meta(chunks, self.block_size)
        with paddle.no_grad():
            hidden = self.model(meta, self.kv_caches)
            logits = self.model.compute_logits(paddle.index_select(hidden, meta.logits_indices, axis=0))
        return logits.numpy()

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        block_tables: list[list[int]],
        prefill_chunk: int | None = None,
    ) -> tuple[list[list[int]], list[np.ndarray]]:
        """Greedy decoding of several prompts in one batch (eos ignored).

        Prompts are prefilled in chunks of ``prefill_chunk`` tokens (all at once when
        ``None``); sequences still prefilling share steps with sequences already decoding.
        Returns the generated ids and the first-step logits of each sequence.
        """
        seqs = [SeqState(list(p), bt) for p, bt in zip(prompts, block_tables)]
        first_logits: list[np.ndarray | None] = [None] * len(seqs)
        while any(len(s.generated) < max_new_tokens for s in seqs):
            chunks, active = [], []
            for i, s in enumerate(seqs):
                if len(s.generated) >= max_new_tokens:
                    continue
                remaining = len(s.tokens) - s.num_computed
                take = remaining if prefill_chunk is None else min(remaining, prefill_chunk)
                chunks.append((s.tokens[s.num_computed : s.num_computed + take], s.num_computed, s.block_table))
                active.append((i, take))
            logits = self.step(chunks)
            for row, (i, take) in enumerate(active):
                s = seqs[i]
                s.num_computed += take
                if s.num_computed == len(s.tokens):  # the last prompt token (or a decode token) ran
                    if first_logits[i] is None:
                        first_logits[i] = logits[row]
                    token = int(np.argmax(logits[row]))
                    s.generated.append(token)
                    s.tokens.append(token)
        return [s.generated for s in seqs], first_logits
