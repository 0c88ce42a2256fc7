"""The cpu kernels over a bfloat16 KV cache (``--kv-cache-dtype bfloat16``).

Attention over a bfloat16 cache multiplies in bfloat16 and adds in float32 (the scaled queries
and the softmax weights rounded to bfloat16; ``csrc/bf16_attention.h``), by ``vdpbf16ps`` on CPUs
with AVX-512 BF16 (path 2) or by widening the tiles to float32 (path 1, any CPU; path 0 picks the
CPU's best). The kernels are held to:

* ``fd_rope_write_kv`` into a bfloat16 cache stores the round-to-nearest-even bfloat16 of what
  it stores into a float32 cache (the same rotated keys, the same values), bit for bit;
* both paths give the same attention (they add in different orders: float32 rounding apart,
  and a weight whose rounding to bfloat16 tips the other way) at short and long (thousands of
  keys, split over threads) contexts, the fused op the same as the two ops;
* the formula on a case computed exactly beside it: rounded queries and rounded weights, each
  rounding shown to matter;
* the fused op and the cpu ops table agree with the reference ops on bfloat16 caches (the
  conformance kit's ``check_bf16_kv_cache``, short and >= 2k-token scenarios).

Prompt chunks (items of 12 or more query rows) multiply in AMX tiles on CPUs with AMX-BF16 (path 3,
and path 0 once the tiles passed their self-check); path 4 runs the same tile loop on a software
model of the instructions (``csrc/amx_attention.h``), on any CPU. The tile path is held to the
same formula and the same agreement with the widen path as vdpbf16ps, and the instructions to
their model bit for bit.

The vdpbf16ps path runs only where the CPU has AVX-512 BF16, the AMX path only where the CPU has
AMX-BF16 and the OS grants the tile state; elsewhere their tests skip saying so (the tile
instructions were executed on an Intel Xeon with AMX, 2026-12-06; on AMD EPYC Zen 4 machines
only their model runs).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.builtin.cpu.device import CpuDevice
from fastdeploy_core.builtin.cpu.kernels import amx_state, has_amx_bf16, has_avx512_bf16, matrix_paths
from fastdeploy_core.builtin.cpu.ops import CpuOps
from fastdeploy_core.testing import checks
from fastdeploy_core.testing.batches import BlockPool, blocks_for, build_meta
from fastdeploy_core.testing.checks import cos_sin_cache

HEADS, KV_HEADS, D, BS = 8, 2, 64, 16


def rne_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest, ties to even (no NaN in these tests)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def bf16_tensor(bits: np.ndarray) -> paddle.Tensor:
    """A paddle bfloat16 tensor holding ``bits``."""
    return paddle.to_tensor(widen(bits)).astype("bfloat16")


def bits_of(tensor: paddle.Tensor) -> np.ndarray:
    return tensor.numpy().view(np.uint16)  # Paddle hands bfloat16 to numpy as its uint16 bits


def test_rne_helper_and_paddle_cast_agree():
    """The premise of the exact tests: Paddle's cast and the numpy emulation both round to
    nearest even (ties included), as the kernel does."""
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20, 3.0e38, 1e-40], dtype=np.float32)
    x = np.concatenate([ties, np.random.default_rng(0).standard_normal(4096).astype(np.float32)])
    np.testing.assert_array_equal(bits_of(paddle.to_tensor(x).astype("bfloat16")), rne_bf16(x))
    assert list(rne_bf16(ties[:3])) == [0x3F80, 0x3F82, 0xBF80]


@pytest.mark.parametrize("tokens", [3, 80], ids=["calling_thread", "pool"])
def test_bf16_cache_write_rounds_specials_as_paddle_on_every_token(tokens, cpu_kernels):
    """Values written into a bfloat16 cache, a few tokens (the calling thread) or a prompt's (16
    at a time on the pool, 16 lanes at a time): Paddle's cast bit for bit, ties to even, infinities
    kept, a NaN as 0x7fff, each token into its own slot (slots out of order)."""
    rng = np.random.default_rng(5)
    nb = blocks_for(tokens, BS) + 1
    specials = np.array([np.nan, np.inf, -np.inf, 1 + 2**-8, 1 + 3 * 2**-8, -0.0, 1e-40, 3.0e38], np.float32)
    qkv = rng.standard_normal((tokens, (HEADS + 2 * KV_HEADS) * D)).astype(np.float32)
    v = qkv[:, (HEADS + KV_HEADS) * D:]
    v[:, : specials.size] = specials  # the values are stored unrotated: exactly these inputs
    slots = rng.permutation(nb * BS)[:tokens].astype(np.int64)
    k, vc = bf16_tensor(np.zeros((nb, BS, KV_HEADS, D), np.uint16)), bf16_tensor(np.zeros((nb, BS, KV_HEADS, D), np.uint16))
    table = paddle.to_tensor(cos_sin_cache(D, tokens).astype(np.float32))
    cpu_kernels.fd_rope_write_kv(paddle.to_tensor(qkv), paddle.to_tensor(np.arange(tokens, dtype=np.int64)), table,
                                 k, vc, paddle.to_tensor(slots), HEADS, KV_HEADS)
    stored = bits_of(vc).reshape(nb * BS, KV_HEADS * D)[slots]
    want = bits_of(paddle.to_tensor(v).astype("bfloat16"))
    np.testing.assert_array_equal(stored, want)
    assert list(stored[0, : specials.size]) == [0x7FFF, 0x7F80, 0xFF80, 0x3F80, 0x3F82, 0x8000, 0x0001, 0x7F62]
    untouched = np.setdiff1d(np.arange(nb * BS), slots)
    assert not bits_of(vc).reshape(nb * BS, -1)[untouched].any()


def _case(specs, seed=0, nb=None):
    rng = np.random.default_rng(seed)
    nb = nb or sum(blocks_for(q + c, BS) for q, c in specs) + 3
    pool = BlockPool(nb, seed=seed)
    chunks = [(list(range(q)), ctx, pool.take(blocks_for(q + ctx, BS))) for q, ctx in specs]
    meta = build_meta(chunks, BS)
    total = sum(q for q, _ in specs)
    qkv = rng.standard_normal((total, (HEADS + 2 * KV_HEADS) * D)).astype(np.float32)
    caches = [rne_bf16(rng.standard_normal((nb, BS, KV_HEADS, D)).astype(np.float32)) for _ in range(2)]
    return meta, qkv, caches


def _step(meta):
    return paddle.to_tensor(meta.query_start_loc), paddle.to_tensor(meta.seq_lens), paddle.to_tensor(meta.block_tables)


SPECS = {
    "decode": [(1, 40)],
    "decode_batch": [(1, 5), (1, 63), (1, 0)],
    "prefill": [(50, 0)],
    "mixed": [(20, 11), (1, 7), (3, 0)],
    "decode_over_2500_keys": [(1, 2500)],  # one long decode: keys split over threads
    "chunk_deep_in_2100_keys_beside_decodes": [(70, 2100), (1, 900), (1, 3)],
}


def tiles_state(model: int = 0) -> int:
    """``fd_attention_amx_state`` (``kernels.amx_state``): 0 no AMX tiles here, 1 the auto path
    multiplies prompt chunks in them, 2 they failed the self-check (``model=1``: the self-check on
    the tile model, 1 = passed)."""
    return amx_state("fd_attention_amx_state", model)


TILES_IN_USE = tiles_state() == 1
NO_TILES = "the AMX tile instructions were not executed: this CPU or kernel has no AMX-BF16 tiles"

#: The attention paths this CPU runs: 1 (widen) and 4 (the tile loop on the tile model)
#: everywhere, 2 (vdpbf16ps) with AVX-512 BF16, 3 (AMX tiles) with AMX-BF16.
PATHS = [1, pytest.param(2, marks=pytest.mark.skipif(not has_avx512_bf16(),
                                                      reason="this CPU has no AVX-512 BF16 (vdpbf16ps)")),
         pytest.param(3, marks=pytest.mark.skipif(not TILES_IN_USE, reason=NO_TILES)), 4]


@pytest.mark.parametrize("specs", list(SPECS.values()), ids=list(SPECS))
@pytest.mark.parametrize("window", [0, 300])
def test_bf16_cache_write_and_both_attention_paths(specs, window, cpu_kernels):
    meta, qkv, (k_bits, v_bits) = _case(specs)
    table = paddle.to_tensor(cos_sin_cache(D, 4096).astype(np.float32))
    scale = D**-0.5

    # float32 caches holding the same (bfloat16-representable) earlier entries
    fk, fv = paddle.to_tensor(widen(k_bits)), paddle.to_tensor(widen(v_bits))
    fq = cpu_kernels.fd_rope_write_kv(paddle.to_tensor(qkv), meta.positions, table, fk, fv, meta.slot_mapping,
                                      HEADS, KV_HEADS)
    bk, bv = bf16_tensor(k_bits), bf16_tensor(v_bits)
    bq = cpu_kernels.fd_rope_write_kv(paddle.to_tensor(qkv), meta.positions, table, bk, bv, meta.slot_mapping,
                                      HEADS, KV_HEADS)
    assert bk.dtype == paddle.bfloat16 and bv.dtype == paddle.bfloat16
    np.testing.assert_array_equal(bq.numpy(), fq.numpy())  # queries: float32, unchanged
    np.testing.assert_array_equal(bits_of(bk), rne_bf16(fk.numpy()))
    np.testing.assert_array_equal(bits_of(bv), rne_bf16(fv.numpy()))
    written = np.asarray(meta.slot_mapping.numpy())
    assert not np.array_equal(bits_of(bk).reshape(-1, KV_HEADS, D)[written], k_bits.reshape(-1, KV_HEADS, D)[written])

    # The two paths compute one formula: float32 rounding apart, bar a weight that rounds the
    # other way to bfloat16 (within the kit's bound, and rare).
    widened = cpu_kernels.fd_paged_attention(bq, bk, bv, *_step(meta), scale, window, 1).numpy()
    auto = cpu_kernels.fd_paged_attention(bq, bk, bv, *_step(meta), scale, window, 0).numpy()
    abs_v = bf16_tensor(rne_bf16(np.abs(widen(bits_of(bv)))))
    weighted_abs = cpu_kernels.fd_paged_attention(bq, bk, abs_v, *_step(meta), scale, window, 1).numpy()
    paths = [4] + ([2] if has_avx512_bf16() else []) + ([3] if TILES_IN_USE else [])
    got = {}
    for path in paths:
        got[path] = cpu_kernels.fd_paged_attention(bq, bk, bv, *_step(meta), scale, window, path).numpy()
        checks.assert_within_weight_rounding(got[path], widened, weighted_abs, f"path {path} against path 1")
        assert np.mean(np.isclose(got[path], widened, rtol=1e-5, atol=1e-6)) > 0.99
    # The CPU's best: tiles for prompt chunks (vdpbf16ps for decodes) where they are in use, else
    # vdpbf16ps, else widening.
    best = 3 if TILES_IN_USE else 2 if has_avx512_bf16() else 1
    np.testing.assert_array_equal(auto, got.get(best, widened))
    # The tile model runs for prompt chunks only: decode-only steps are the narrow paths' bits;
    # with a prompt chunk of 12+ rows it sums in the tiles' order, which shows in some bits.
    narrow = 2 if has_avx512_bf16() else 1
    narrow_out = got.get(narrow, widened)
    if all(q == 1 for q, _ in specs):
        np.testing.assert_array_equal(got[4], narrow_out)
    else:
        assert not np.array_equal(got[4], narrow_out)
    if TILES_IN_USE:  # the instructions against their model: bit for bit
        np.testing.assert_array_equal(got[3], got[4])
    # ... and not what the unrounded float32 cache gives (the rounding is really read).
    unrounded = cpu_kernels.fd_paged_attention(fq, fk, fv, *_step(meta), scale, window, 0)
    assert not np.array_equal(auto, unrounded.numpy())

    # The fused op: both steps in one call, the same caches and output.
    ck, cv = bf16_tensor(k_bits), bf16_tensor(v_bits)
    fused = cpu_kernels.fd_rope_paged_attention(
        paddle.to_tensor(qkv), meta.positions, table, ck, cv, meta.slot_mapping, *_step(meta),
        HEADS, KV_HEADS, scale, window, 0,
    )
    np.testing.assert_array_equal(fused.numpy(), auto.reshape(fused.shape))
    np.testing.assert_array_equal(bits_of(ck), bits_of(bk))
    np.testing.assert_array_equal(bits_of(cv), bits_of(bv))


def _one_hot_case(q_len: int, ctx: int, seed: int = 3):
    """A sequence whose scores are exact single products: key j is a_j e_0 (a_j in {1, 2, 3}, exact
    in bfloat16), so row (token, head) scores key j as a_j * bf16(q[token, head, 0]); values are
    bfloat16 rows that follow a_j. Returns what the kernel takes and what the formula needs."""
    rng = np.random.default_rng(seed)
    nb = blocks_for(q_len + ctx, BS) + 2
    pool = BlockPool(nb, seed=seed)
    meta = build_meta([(list(range(q_len)), ctx, pool.take(blocks_for(q_len + ctx, BS)))], BS)
    n = q_len + ctx
    a = rng.integers(1, 4, size=(n, KV_HEADS)).astype(np.float32)
    # values follow a_j (plus noise), so the output measures how the weights split between the
    # a groups and does not average out over long contexts
    noise = 0.1 * rng.standard_normal((n, KV_HEADS, D))
    v_rows = widen(rne_bf16((a[:, :, None] - 2.0 + noise).astype(np.float32)))
    k_cache = np.zeros((nb, BS, KV_HEADS, D), np.float32)
    v_cache = np.zeros((nb, BS, KV_HEADS, D), np.float32)
    table = np.asarray(meta.block_tables)[0]
    for p in range(n):
        k_cache[table[p // BS], p % BS, :, 0] = a[p]
        v_cache[table[p // BS], p % BS] = v_rows[p]
    # q values ~3: bfloat16 steps there are 2^-6, so rounding moves a score by up to ~1.5%.
    q = np.zeros((q_len, HEADS, D), np.float32)
    q[:, :, 0] = 3.0 + rng.uniform(-0.5, 0.5, size=(q_len, HEADS)).astype(np.float32)
    return meta, q, a, v_rows, bf16_tensor(rne_bf16(k_cache)), bf16_tensor(rne_bf16(v_cache))


def _formula(q, a, v_rows, ctx, round_q=True, round_p=True):
    """The bfloat16-cache attention of ``_one_hot_case`` in numpy, float64 sums."""
    q_len, group = q.shape[0], HEADS // KV_HEADS
    out = np.zeros((q_len, HEADS, D))
    for t in range(q_len):
        keys = ctx + t + 1
        for h in range(HEADS):
            g = h // group
            qv = widen(rne_bf16(q[t, h, :1]))[0] if round_q else q[t, h, 0]
            s = a[:keys, g].astype(np.float64) * qv
            top = np.float32(s.max())
            lattice = np.float32(np.ceil(top * np.float32(1.4426950408889634)) * np.float32(0.6931471805599453))
            p = np.exp((s - lattice).astype(np.float32))  # M: the smallest multiple of ln 2 >= max s
            w = widen(rne_bf16(p)) if round_p else p
            out[t, h] = (w[:, None].astype(np.float64) * v_rows[:keys, g]).sum(0) / p.astype(np.float64).sum()
    return out


@pytest.mark.parametrize("path", PATHS)
# prefill over 300 keys: key tiles of 128 on the AMX path (two whole, one of 44; 64 elsewhere).
@pytest.mark.parametrize("q_len, ctx", [(1, 50), (1, 700), (30, 40), (30, 300)],
                         ids=["decode", "decode_two_tiles", "prefill", "prefill_key_tiles"])
def test_bf16_cache_attention_is_the_formula(path, q_len, ctx, cpu_kernels):
    """Rounded queries and rounded weights: the kernel equals the formula computed beside it, and
    the formula without either rounding is far outside the tolerance (each rounding matters)."""
    meta, q, a, v_rows, k, v = _one_hot_case(q_len, ctx)
    got = cpu_kernels.fd_paged_attention(paddle.to_tensor(q), k, v, *_step(meta), 1.0, 0, path).numpy()
    want = _formula(q, a, v_rows, ctx)
    tol = 3e-6
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    assert np.abs(_formula(q, a, v_rows, ctx, round_q=False) - want).max() > 50 * tol
    assert np.abs(_formula(q, a, v_rows, ctx, round_p=False) - want).max() > 3 * tol


def test_bad_attention_paths_are_refused(cpu_kernels):
    """An unknown path always; path 2 where the CPU lacks AVX-512 BF16 and path 3 where it has no
    AMX-BF16 tiles (each runs elsewhere)."""
    meta, q, a, v_rows, k, v = _one_hot_case(1, 10)
    for bad in (5, -1):
        with pytest.raises(Exception, match=r"bf16_path must be 0 .* 4 \(AMX tiles on their software model\), got"):
            cpu_kernels.fd_paged_attention(paddle.to_tensor(q), k, v, *_step(meta), 1.0, 0, bad)
    if not has_avx512_bf16():
        with pytest.raises(Exception, match="needs AVX-512 BF16"):
            cpu_kernels.fd_paged_attention(paddle.to_tensor(q), k, v, *_step(meta), 1.0, 0, 2)
    if not has_amx_bf16():
        with pytest.raises(Exception, match="bf16_path 3 needs AMX-BF16 tiles granted by the OS"):
            cpu_kernels.fd_paged_attention(paddle.to_tensor(q), k, v, *_step(meta), 1.0, 0, 3)


def test_the_tiles_state_and_their_self_check(cpu_kernels):
    """The auto path takes tiles exactly where the CPU lists AMX-BF16 (the OS granting the state and
    the self-check passing there); the self-check itself passes on the tile model; benchmarks
    record the choice."""
    assert tiles_state() == (1 if has_amx_bf16() else 0)
    assert tiles_state(model=1) == 1
    want = "amx tiles (tdpbf16ps)" if has_amx_bf16() else "vdpbf16ps" if has_avx512_bf16() else "widen to float32"
    assert matrix_paths()["bf16_kv_prompt_attention"] == want


def test_mixed_cache_dtypes_are_refused(cpu_kernels):
    meta, qkv, (k_bits, v_bits) = _case(SPECS["decode"])
    table = paddle.to_tensor(cos_sin_cache(D, 256).astype(np.float32))
    with pytest.raises(Exception, match="k_cache and v_cache must have one dtype"):
        cpu_kernels.fd_rope_write_kv(paddle.to_tensor(qkv), meta.positions, table, bf16_tensor(k_bits),
                                     paddle.to_tensor(widen(v_bits)), meta.slot_mapping, HEADS, KV_HEADS)
    with pytest.raises(Exception, match="must be float32 or bfloat16"):
        half = [bf16_tensor(bits).astype("float16") for bits in (k_bits, v_bits)]
        cpu_kernels.fd_rope_write_kv(paddle.to_tensor(qkv), meta.positions, table, *half, meta.slot_mapping,
                                     HEADS, KV_HEADS)


@pytest.mark.parametrize("scenario", ["decode", "prefix_cached_chunked", "sliding_window", "long_context",
                                      "long_sliding_window"])
def test_cpu_ops_match_the_reference_on_a_bf16_cache(scenario, cpu_kernels):
    """The conformance kit's check on the cpu device's own table (its kernels), short and long
    (3,000-key) contexts; ``long_context`` and ``long_sliding_window`` reach >= 2k tokens."""
    assert max(q + c for q, c in checks.ATTENTION_SCENARIOS[scenario]) >= (2000 if "long" in scenario else 1)
    checks.check_bf16_kv_cache(checks.make_target(CpuDevice, CpuOps), scenario, CpuDevice.attention_backends[0])


def test_the_kit_check_fails_a_table_that_ignores_the_rounding():
    """The check can fail: a table that writes the float32 values into a float32 copy and
    attends over that (never reading the bfloat16 it stores) differs from the reference."""

    class Unrounded(CpuOps):
        def rope_paged_attention(self, qkv, positions, cos_sin_cache, k_cache, v_cache, meta, *args):
            fk, fv = k_cache.astype("float32"), v_cache.astype("float32")
            out = super().rope_paged_attention(qkv, positions, cos_sin_cache, fk, fv, meta, *args)
            k_cache.copy_(fk.astype("bfloat16"), False)
            v_cache.copy_(fv.astype("bfloat16"), False)
            return out

    with pytest.raises(AssertionError, match="bf16 KV cache prefill"):
        checks.check_bf16_kv_cache(checks.make_target(CpuDevice, Unrounded), "prefill", CpuDevice.attention_backends[0])
