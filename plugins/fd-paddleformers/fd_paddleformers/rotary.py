"""A cheaper, bit-identical rotary application for PaddleFormers families that use rotate_half.

PaddleFormers applies RoPE inside each attention module with its family's module-level
``apply_rotary_pos_emb(q, k, cos, sin)``. For the standard ``rotate_half`` form (Llama) that is
~18 Paddle ops per layer (unsqueezes, slices, a negation, concatenations, casts); at batch-1
decode, where eager op dispatch dominates, that is most of the fallback's cost over the native
model. ``x * cos + rotate_half(x) * sin`` equals ``x * cos + roll(x, d/2) * sin_signed`` with
``sin_signed = [-sin[:d/2], sin[d/2:]]`` exactly (negation is exact in IEEE float), which is 4
ops per tensor once ``sin_signed`` is built per step.

:func:`install_fast_rotary` replaces a family module's function only after checking, on random
inputs, that its output is bitwise equal to PaddleFormers' original; other forms (Ernie 4.5's
interleaved pairs, Phi3's partial rotary) fail the check and keep the original. Outside a
fallback step the replacement calls the original, so other users of the module are unaffected.
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import paddle

logger = logging.getLogger(__name__)

_FAST_MARK = "_fd_fast_rotary_original"
#: number of fallback forward steps running (the fast form only serves those)
_active_steps = 0


class fallback_step:
    """Context manager marking a fallback forward step (where the fast form may run)."""

    def __enter__(self):
        global _active_steps
        _active_steps += 1

    def __exit__(self, *exc):
        global _active_steps
        _active_steps -= 1


def in_fallback_step() -> bool:
    return _active_steps > 0


class _SignedSinCache:
    """``(cos [B, 1, T, d], sin_signed [B, 1, T, d])`` of the step's cos/sin, built once per step."""

    def __init__(self):
        self.key = None
        self.value = None

    def get(self, cos: paddle.Tensor, sin: paddle.Tensor):
        if self.key is not None and self.key[0] is cos and self.key[1] is sin:
            return self.value
        half = sin.shape[-1] // 2
        signed = paddle.concat([-sin[..., :half], sin[..., half:]], axis=-1)
        self.key = (cos, sin)
        self.value = (cos.unsqueeze(1), signed.unsqueeze(1))
        return self.value


def _make_fast(original, is_active):
    cache = _SignedSinCache()

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, **kwargs):
        partial = cos.shape[-1] != q.shape[-1]  # e.g. Phi3 with partial_rotary_factor < 1
        if partial or not is_active() or unsqueeze_dim != 1 or kwargs or q.dtype != paddle.float32:
            return original(q, k, cos, sin, position_ids, unsqueeze_dim, **kwargs)
        cos4, sin4 = cache.get(cos, sin)
        half = q.shape[-1] // 2
        q_embed = q * cos4 + paddle.roll(q, half, axis=-1) * sin4
        k_embed = k * cos4 + paddle.roll(k, half, axis=-1) * sin4
        return q_embed, k_embed

    setattr(apply_rotary_pos_emb, _FAST_MARK, original)
    return apply_rotary_pos_emb


def _bitwise_equal(original, fast) -> bool:
    rng = np.random.default_rng(0)
    q = paddle.to_tensor(rng.standard_normal((1, 4, 5, 16)).astype(np.float32))
    k = paddle.to_tensor(rng.standard_normal((1, 2, 5, 16)).astype(np.float32))
    angles = rng.uniform(0, 6, (1, 5, 8)).astype(np.float32)
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = paddle.to_tensor(np.cos(angles)), paddle.to_tensor(np.sin(angles))
    try:
        want = original(q, k, cos, sin)
        got = fast(q, k, cos, sin)
    except Exception:  # a different signature or shape contract: not the standard form
        return False
    return all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(want, got))


def install_fast_rotary(module_name: str) -> bool:
    """Swap ``module_name.apply_rotary_pos_emb`` for the fast form if bit-identical; True if it is now."""
    module = sys.modules.get(module_name)
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is None:
        return False
    if hasattr(original, _FAST_MARK):
        return True
    fast = _make_fast(original, lambda: True)
    if not _bitwise_equal(original, fast):
        logger.info("%s.apply_rotary_pos_emb is not the rotate_half form; keeping PaddleFormers' own", module_name)
        return False
    module.apply_rotary_pos_emb = _make_fast(original, in_fallback_step)
    return True
