"""``ngram``: prompt lookup decoding.

When a request's last ``n`` tokens occurred earlier in its own context (prompt or output), the
tokens that followed that earlier occurrence are a cheap guess for what comes next: rewriting,
quoting or continuing a given text or code repeats long runs. Suffix lengths are tried from
``max_ngram_size`` down to ``min_ngram_size``; the most recent earlier occurrence wins (it
reflects the latest turn of the text). No model runs, so a step that finds nothing costs a
few array comparisons.
"""

from __future__ import annotations

import numpy as np

from fastdeploy_core.spec_decode.base import DraftRequest, Proposer


def lookup_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` (``min_n <= length <= max_n``) that has one; ``[]`` when none matches."""
    length = tokens.shape[0]
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # candidate starts i with tokens[i:i+n] == suffix and i + n < length (a continuation exists)
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    """Drafts by looking the context's suffix up in the context itself (see the module docstring)."""

    reads = frozenset({"max_ngram_size", "min_ngram_size"})

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        cfg = self.config
        return [
            lookup_ngram(np.asarray(r.token_ids, dtype=np.int64), cfg.min_ngram_size, cfg.max_ngram_size, r.max_tokens)
            for r in requests
        ]
