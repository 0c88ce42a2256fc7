"""Token sampling from the logits of one step.

Greedy batches (no penalties, no logprobs, nothing masked) take a fast path: one ``argmax`` on
the device, or, when the model has ``compute_greedy_tokens`` (:meth:`Sampler.all_plain_greedy`
tells the runner), no logits at all: the device's ``greedy_lm_head`` gives the tokens.
Everything else runs on the host in numpy, one row per sequence (this is sampling, not the
forward pass): repetition / frequency / presence penalties, ``bad_words``, masking of
stop tokens before ``min_tokens``, temperature, top-k, top-p, min-p, then inverse-CDF sampling
with a uniform drawn from the request's own ``numpy.random.Generator`` — so a seeded request
draws exactly one number per generated token and gets the same tokens whatever else is in
the batch.

Guided decoding gives a row a token bitmask (``ScheduledRequest.token_bitmask``): its disallowed
tokens get ``-inf`` after the penalties, on the host path, so a masked row never takes the greedy
fast path (the device's argmax or greedy head would pick the unmasked best token); rows without a
mask in the same batch are sampled as they would be alone.

Logprobs are the log-softmax of the raw logits (before penalties and temperature): a dict per
token with the sampled token first, then the top ``logprobs`` tokens by rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy_core.executor.step_io import ScheduledRequest


@dataclass
class SamplerOutput:
    """``token_ids[i]`` sampled for row ``i``; ``logprobs[i]`` when that request asked."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64, copy=False)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def top_logprobs(row_logprobs: np.ndarray, chosen: int, num: int) -> dict[int, float]:
    """``{chosen: lp, top1: lp, ...}`` (the chosen token first, then ``num`` best by rank)."""
    out = {int(chosen): float(row_logprobs[chosen])}
    if num > 0:
        top = np.argpartition(-row_logprobs, num - 1)[:num]
        top = top[np.argsort(-row_logprobs[top], kind="stable")]
        for tok in top:
            out.setdefault(int(tok), float(row_logprobs[tok]))
    return out


def _needs_host(req: ScheduledRequest) -> bool:
    sp = req.sampling_params
    return (
        not sp.is_greedy
        or sp.logprobs is not None
        or sp.resolved("repetition_penalty") != 1.0
        or sp.presence_penalty != 0.0
        or sp.frequency_penalty != 0.0
        or bool(sp.bad_words_token_ids)
        or req.num_output_tokens < sp.min_tokens
        or _bitmask(req) is not None
    )


def _bitmask(req) -> np.ndarray | None:
    # Rows built by hand (tests, harnesses) may be any object with the row's sampling fields.
    return getattr(req, "token_bitmask", None)


def allowed_tokens(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """The bool mask of the first ``vocab`` tokens from an int32 bitmask (bit ``t % 32`` of word
    ``t // 32``, words little-endian)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask, dtype="<i4").view(np.uint8), bitorder="little")
    allowed = np.zeros(vocab, dtype=bool)
    n = min(vocab, bits.shape[0])
    allowed[:n] = bits[:n].astype(bool)
    return allowed


class Sampler:
    """Samples one token per row of ``logits [B, V]`` for the scheduled rows ``reqs``."""

    @staticmethod
    def all_plain_greedy(reqs: list[ScheduledRequest]) -> bool:
        """Whether every row is a plain argmax (greedy, no logprobs, penalties, bad words,
        min_tokens mask or guided-decoding mask): then only each row's argmax of the logits matters, and a model may
        give the tokens without them (``compute_greedy_tokens``)."""
        return not any(_needs_host(r) for r in reqs)

    @staticmethod
    def greedy_output(token_ids) -> SamplerOutput:
        """The output of a plain greedy step whose tokens the model computed."""
        return SamplerOutput([int(t) for t in token_ids], [None] * len(token_ids))

    def __call__(self, logits, reqs: list[ScheduledRequest]) -> SamplerOutput:
        if self.all_plain_greedy(reqs):
            if isinstance(logits, np.ndarray):
                ids = logits.argmax(axis=-1).reshape(-1)
            else:
                from fastdeploy_core.devices.current import current_ops

                ids = current_ops().argmax_rows(logits)
            return SamplerOutput([int(t) for t in ids], [None] * len(reqs))
        host = logits.numpy() if hasattr(logits, "numpy") else np.asarray(logits)
        tokens: list[int] = []
        logprobs: list[dict[int, float] | None] = []
        for row, req in zip(host, reqs):
            token = self.sample_row(row, req)
            tokens.append(token)
            if req.sampling_params.logprobs is not None:
                logprobs.append(top_logprobs(log_softmax(row), token, req.sampling_params.logprobs))
            else:
                logprobs.append(None)
        return SamplerOutput(tokens, logprobs)

    @staticmethod
    def apply_penalties_and_masks(row: np.ndarray, req: ScheduledRequest) -> np.ndarray:
        """Penalties, bad words and the min_tokens mask on a float32 copy of ``row``."""
        sp = req.sampling_params
        x = np.array(row, dtype=np.float32, copy=True)
        vocab = x.shape[0]
        rep = sp.resolved("repetition_penalty")
        if rep != 1.0:
            seen = np.unique(np.asarray(req.all_token_ids, dtype=np.int64))
            seen = seen[seen < vocab]
            vals = x[seen]
            x[seen] = np.where(vals > 0, vals / rep, vals * rep)
        if (sp.frequency_penalty or sp.presence_penalty) and req.output_token_ids:
            ids, counts = np.unique(np.asarray(req.output_token_ids, dtype=np.int64), return_counts=True)
            keep = ids < vocab
            ids, counts = ids[keep], counts[keep]
            x[ids] -= sp.frequency_penalty * counts + sp.presence_penalty
        if sp.bad_words_token_ids:
            out = req.output_token_ids
            for seq in sp.bad_words_token_ids:
                prefix = seq[:-1]
                prefix_matches = not prefix or (len(out) >= len(prefix) and out[len(out) - len(prefix) :] == prefix)
                if prefix_matches and seq[-1] < vocab:
                    x[seq[-1]] = -np.inf
        bitmask = _bitmask(req)
        if bitmask is not None:
            x[~allowed_tokens(bitmask, vocab)] = -np.inf
        if req.num_output_tokens < sp.min_tokens:
            eos = [tok for tok in req.eos_token_ids if tok < vocab]
            saved = x[eos].copy()
            x[eos] = -np.inf
            if bitmask is not None and not np.isfinite(x).any():
                x[eos] = saved  # the grammar is complete: its end wins over min_tokens
        return x

    def sample_row(self, row: np.ndarray, req: ScheduledRequest, position: int | None = None) -> int:
        """The token of ``req`` at output position ``position`` (default: the next one) from
        its logits ``row``: penalties and masks, then greedy or temperature / top-k / top-p /
        min-p sampling with :func:`position_uniform`."""
        sp = req.sampling_params
        x = self.apply_penalties_and_masks(row, req)
        if sp.is_greedy:
            return int(np.argmax(x))
        x = x.astype(np.float64) / sp.resolved("temperature")
        top_k = sp.resolved("top_k")
        if 0 < top_k < x.shape[0]:
            kth = np.partition(x, -top_k)[-top_k]
            x[x < kth] = -np.inf
        probs = np.exp(x - np.max(x))
        probs /= probs.sum()
        top_p = sp.resolved("top_p")
        if top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            # keep the smallest prefix whose mass reaches top_p (always the best token)
            cut = int(np.searchsorted(cum, top_p, side="left")) + 1
            mask = np.ones_like(probs, dtype=bool)
            mask[order[:cut]] = False
            probs[mask] = 0.0
        min_p = sp.resolved("min_p")
        if min_p > 0.0:
            probs[probs < min_p * probs.max()] = 0.0
        cdf = np.cumsum(probs)
        u = position_uniform(req.sample_seed, req.num_output_tokens if position is None else position)
        token = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        token = min(token, x.shape[0] - 1)
        while probs[token] == 0.0 and token > 0:  # float edge at the top of the CDF
            token -= 1
        return token


def position_uniform(sample_seed: int | None, position: int) -> float:
    """The uniform number in [0, 1) that picks a request's token at output position ``position``.

    A function of the request's sampling seed and the position, not a stream: the token a
    sampled request gets at a position is the same whatever batch it ran in and whether a
    speculative step verified it beside others. So a drafted token is kept exactly when it is
    the token one-token-per-step sampling would have drawn there, and speculation leaves a
    sampled request's tokens unchanged, as it does a greedy one's. ``None`` (rows built by hand)
    draws from numpy's global stream.
    """
    if sample_seed is None:
        return float(np.random.random())
    # A counter-based draw: the SplitMix64 finalizer over (seed, position), 53 bits. About 0.5 us,
    # against ~11 us to seed a numpy generator per sampled token (a cost on every step's rows).
    z = _mix64((sample_seed & _MASK64) ^ _mix64(position + _GOLDEN))
    return (z >> 11) * 2.0**-53


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """SplitMix64's output function: a bijection of 64-bit integers that scatters every bit."""
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def verify_drafts(target_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """Acceptance of speculative drafts by exact match: the tokens a speculating row emits.

    ``target_token_ids[j]`` is the target's token after the row's last token and the first
    ``j`` drafts (``k + 1`` of them for ``k`` drafts): its argmax for a greedy row, its draw
    with :func:`position_uniform` at that output position for a sampled one. Drafts are kept while each equals
    the target's token at its position; the target's token at the first disagreement (or after
    the last draft) follows. Every emitted token is the target's own argmax given the tokens
    before it, so the output is exactly what one-token-per-step greedy decoding gives.
    """
    out: list[int] = []
    for target, draft in zip(target_token_ids, draft_token_ids):
        out.append(int(target))
        if int(target) != int(draft):
            return out
    out.append(int(target_token_ids[len(draft_token_ids)]))
    return out

