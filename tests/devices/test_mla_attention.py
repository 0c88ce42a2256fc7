"""Multi-head latent attention over a paged latent cache: the reference op against a plain
per-sequence formula, its absorbed decode against its expanded form, and the kit's check
(passing on the cpu device, failing on a wrong absorbed form)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.layers.kv_layout import KVCacheLayout
from fastdeploy_core.plugins import load_plugins
from fastdeploy_core.testing import checks
from fastdeploy_core.testing.batches import BlockPool, blocks_for, build_meta

HEADS, RANK, NOPE, ROPE, V_DIM, BS, NB = 3, 20, 12, 6, 10, 4, 40


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _per_sequence(q, latent_rows, w_kv, scale, context: int) -> np.ndarray:
    """One sequence's ``q [n, h, dn + dr]`` over its rows ``[context + n, L + dr]``, keys and
    values expanded per head, causal: the formula the op documents, in float64."""
    c, k_pe = latent_rows[:, :RANK], latent_rows[:, RANK:]
    out = np.zeros((q.shape[0], HEADS, V_DIM))
    for h in range(HEADS):
        k = np.concatenate([c @ w_kv[h, :, :NOPE], k_pe], axis=-1)
        v = c @ w_kv[h, :, NOPE:]
        scores = (q[:, h] @ k.T) * scale
        visible = np.arange(len(c))[None, :] <= context + np.arange(q.shape[0])[:, None]
        out[:, h] = _softmax(np.where(visible, scores, -np.inf)) @ v
    return out.reshape(q.shape[0], HEADS * V_DIM)


@pytest.mark.parametrize("scenario", sorted(checks.ATTENTION_SCENARIOS))
@pytest.mark.parametrize("form", ["auto", "absorbed", "expanded"])
def test_reference_op_matches_the_per_sequence_formula(scenario, form):
    rng = np.random.default_rng(5)
    specs = checks.ATTENTION_SCENARIOS[scenario]
    nb = max(NB, sum(blocks_for(n + ctx, BS) for n, ctx in specs) + 1)  # the long scenarios need more
    pool = BlockPool(nb, seed=2)
    chunks = [(list(range(n)), ctx, pool.take(blocks_for(n + ctx, BS))) for n, ctx in specs]
    cache = rng.standard_normal((nb, BS, 1, RANK + ROPE)).astype(np.float32)
    total = sum(n for n, _ in specs)
    q = rng.standard_normal((total, HEADS, NOPE + ROPE)).astype(np.float32)
    latent = rng.standard_normal((total, RANK + ROPE)).astype(np.float32)
    w_kv = (rng.standard_normal((HEADS, RANK, NOPE + V_DIM)) / np.sqrt(RANK)).astype(np.float32)
    scale = 0.3
    meta = build_meta(chunks, BS)
    tc = paddle.to_tensor(cache)
    got = ReferenceOps().mla_paged_attention(
        paddle.to_tensor(q), paddle.to_tensor(latent), tc, meta, paddle.to_tensor(w_kv), scale, form
    )
    flat = cache.reshape(nb * BS, RANK + ROPE).astype(np.float64)
    start = 0
    for (n, ctx), (_, _, table) in zip(specs, chunks):
        slots = [table[p // BS] * BS + p % BS for p in range(ctx + n)]
        flat[slots[ctx:]] = latent[start : start + n]
        want = _per_sequence(q[start : start + n].astype(np.float64), flat[slots], w_kv.astype(np.float64), scale, ctx)
        np.testing.assert_allclose(got.numpy()[start : start + n], want, atol=2e-5, err_msg=f"{scenario} {form}")
        start += n
    np.testing.assert_allclose(tc.numpy().reshape(nb * BS, -1), flat.astype(np.float32), atol=0, err_msg="cache write")


def test_unknown_form_is_refused():
    meta = build_meta([([1], 0, [1])], BS)
    with pytest.raises(ValueError, match="form 'fast' is not one of auto, absorbed, expanded"):
        ReferenceOps().mla_paged_attention(
            paddle.zeros([1, 1, 4]),
            paddle.zeros([1, 6]),
            paddle.zeros([2, BS, 1, 6]),
            meta,
            paddle.zeros([1, 4, 4]),
            1.0,
            "fast",
        )


@pytest.mark.parametrize("scenario", sorted(checks.ATTENTION_SCENARIOS))
def test_kit_check_passes_on_the_cpu_device(scenario):
    target = checks.make_target(load_plugins().devices.get("cpu"))
    for backend in target.device.attention_backends:
        checks.check_mla_paged_attention(target, scenario, backend, "float32")


class _AbsorbedWithoutRope(ReferenceOps):
    """A wrong absorbed form: it drops the rotary part of the scores."""

    def mla_paged_attention(self, q, latent, latent_cache, meta, w_kv, scale, form="auto"):
        if form == "expanded":
            return super().mla_paged_attention(q, latent, latent_cache, meta, w_kv, scale, form)
        rope = latent.shape[-1] - w_kv.shape[1]
        q = paddle.concat([q[:, :, : q.shape[2] - rope], paddle.zeros_like(q[:, :, q.shape[2] - rope :])], axis=-1)
        return super().mla_paged_attention(q, latent, latent_cache, meta, w_kv, scale, "absorbed")


def test_kit_check_fails_on_a_wrong_absorbed_form():
    target = checks.make_target(load_plugins().devices.get("cpu"), ops_class=_AbsorbedWithoutRope)
    with pytest.raises(AssertionError, match=r"mla_paged_attention\[.*\] (auto|absorbed) decode"):
        checks.check_mla_paged_attention(target, "decode", target.device.attention_backends[0], "float32")


def test_latent_layout_counts_one_row_per_token():
    layout = KVCacheLayout.latent(3, 512, 64)
    assert layout.bytes_per_token() == 4 * 576 and layout.kind == "latent"
    assert KVCacheLayout.key_value(3, 8, 128).bytes_per_token() == 4 * 2 * 8 * 128
    caches = layout.allocate(5, 16, lambda shape, dtype: paddle.zeros(shape, dtype))
    assert len(caches) == 3 and [list(c.shape) for c in caches[0]] == [[5, 16, 1, 576]]
