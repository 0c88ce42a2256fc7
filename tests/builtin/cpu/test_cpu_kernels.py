"""The cpu device's C++ ops called directly: ``fd_rope_write_kv``, ``fd_paged_attention``, and the
input checks of ``fd_rms_norm`` / ``fd_add_rms_norm`` / ``fd_silu_mul``.

The conformance kit (``check_rope_paged_attention``) compares the fused block as the cpu ops
table runs it; these tests call the kernels themselves, including query runs longer than the
table sends them (it routes long prefills to the reference), and their input checks.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.builtin.cpu.kernels import has_avx512_bf16
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.testing.batches import BlockPool, blocks_for, build_meta
from fastdeploy_core.testing.checks import cos_sin_cache

HEADS, KV_HEADS, D, BS, NB = 9, 3, 64, 8, 40


def _case(specs, seed=0):
    rng = np.random.default_rng(seed)
    pool = BlockPool(NB, seed=seed)
    chunks = [(list(range(q)), ctx, pool.take(blocks_for(q + ctx, BS))) for q, ctx in specs]
    meta = build_meta(chunks, BS)
    total = sum(q for q, _ in specs)
    qkv = rng.standard_normal((total, (HEADS + 2 * KV_HEADS) * D)).astype(np.float32)
    caches = [rng.standard_normal((NB, BS, KV_HEADS, D)).astype(np.float32) for _ in range(2)]
    return meta, qkv, caches


def _attend(cpu_kernels, q, k, v, meta, scale, window):
    """``fd_paged_attention`` over the step described by ``meta``."""
    step = (paddle.to_tensor(meta.query_start_loc), paddle.to_tensor(meta.seq_lens), paddle.to_tensor(meta.block_tables))
    return cpu_kernels.fd_paged_attention(q, k, v, *step, scale, window, 0)


@pytest.mark.parametrize(
    "specs",
    [[(1, 40)], [(1, 5), (1, 63), (1, 0)], [(50, 0)], [(20, 11), (1, 7), (3, 0)]],
    ids=["decode", "decode_batch", "long_prefill", "mixed"],
)
@pytest.mark.parametrize("window", [0, 5])
def test_kernels_match_the_reference_ops(specs, window, cpu_kernels):
    meta, qkv, (k0, v0) = _case(specs)
    table = paddle.to_tensor(cos_sin_cache(D, 256).astype(np.float32))
    scale = D**-0.5
    ref = ReferenceOps()
    rk, rv = paddle.to_tensor(k0), paddle.to_tensor(v0)
    want = ref.rope_paged_attention(
        paddle.to_tensor(qkv), meta.positions, table, rk, rv, meta, HEADS, KV_HEADS, scale, window or None
    )

    k, v = paddle.to_tensor(k0), paddle.to_tensor(v0)
    q = cpu_kernels.fd_rope_write_kv(paddle.to_tensor(qkv), meta.positions, table, k, v, meta.slot_mapping, HEADS, KV_HEADS)
    assert tuple(q.shape) == (qkv.shape[0], HEADS, D)
    np.testing.assert_allclose(k.numpy(), rk.numpy(), rtol=0, atol=1e-5)  # the same slots, rotated keys
    np.testing.assert_array_equal(v.numpy(), rv.numpy())  # values copied as they are
    out = _attend(cpu_kernels, q, k, v, meta, scale, window)
    np.testing.assert_allclose(out.numpy().reshape(want.shape), want.numpy(), rtol=1e-4, atol=1e-5)

    # The fused op the cpu table calls: both steps in one, [T, h * d] out, the same caches.
    fk, fv = paddle.to_tensor(k0), paddle.to_tensor(v0)
    step = (paddle.to_tensor(meta.query_start_loc), paddle.to_tensor(meta.seq_lens), paddle.to_tensor(meta.block_tables))
    fused = cpu_kernels.fd_rope_paged_attention(
        paddle.to_tensor(qkv), meta.positions, table, fk, fv, meta.slot_mapping, *step, HEADS, KV_HEADS, scale, window, 0
    )
    assert tuple(fused.shape) == (qkv.shape[0], HEADS * D)
    np.testing.assert_array_equal(fused.numpy(), out.numpy().reshape(fused.shape))
    np.testing.assert_array_equal(fk.numpy(), k.numpy())
    np.testing.assert_array_equal(fv.numpy(), v.numpy())


@pytest.mark.parametrize(
    "specs",
    [[(1, 1500)], [(2, 700)], [(1, 30)], [(6, 200), (1, 9)], [(1, 3500)], [(100, 2600), (1, 900), (40, 0)]],
    ids=[
        "one_long_decode_split",
        "two_long_decodes_split",
        "one_short_decode",
        "rows_per_token",
        "decode_over_3500_keys",
        "chunk_deep_in_2700_keys_beside_decode_and_prompt",
    ],
)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 32), (2, 1, 128), (6, 2, 24), (4, 4, 16)])
def test_paged_attention_every_head_size_and_work_split(specs, heads, kv_heads, head_dim, cpu_kernels):
    """Head sizes 16/32/48/64/128 run register-tiled code, others (24) the generic loops; items of
    few rows (a decode's group of heads) compute scores row by row, wider ones against transposed
    queries; a step with too few items for the threads splits long key ranges and combines the
    parts. At thousands of keys too, all must equal the reference."""
    block_size, num_blocks = 16, 600
    rng = np.random.default_rng(7)
    pool = BlockPool(num_blocks, seed=3)
    chunks = [(list(range(q)), ctx, pool.take(blocks_for(q + ctx, block_size))) for q, ctx in specs]
    meta = build_meta(chunks, block_size)
    total = sum(q for q, _ in specs)
    q = rng.standard_normal((total, heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    scale = head_dim**-0.5
    for window in (0, 100):
        want = ReferenceOps().paged_attention(
            paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(v), meta, scale, window or None
        )
        out = _attend(cpu_kernels, paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(v), meta, scale, window)
        np.testing.assert_allclose(out.numpy().reshape(want.shape), want.numpy(), rtol=1e-4, atol=1e-5)


#: Cache dtypes and attention paths this CPU runs (bfloat16 path 2 is vdpbf16ps, path 1 widening).
CACHE_PATHS = [
    ("float32", 0),
    ("bfloat16", 1),
    pytest.param("bfloat16", 2, marks=pytest.mark.skipif(not has_avx512_bf16(), reason="this CPU has no AVX-512 BF16")),
]


@pytest.mark.parametrize("cache_dtype,path", CACHE_PATHS, ids=["float32", "bf16_widen", "bf16_dot"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 32), (4, 4, 16), (6, 2, 24), (2, 1, 128), (12, 4, 32)]
)  # (12, 4): items of 3 kv heads and one of the 4th
def test_many_decodes_give_each_row_the_bits_it_gets_alone(cache_dtype, path, heads, kv_heads, head_dim, cpu_kernels):
    """A step with enough decode tokens puts the query heads of several kv heads of a token in
    one work item (9 heads of 3 kv heads at SmolLM2's shape); a token decoded alone has one item
    per kv head. Each row's result must be the same bits either way (and beside a prompt chunk),
    whatever the batch: requests' tokens do not depend on what they are batched with."""
    block_size, num_blocks = 16, 400
    specs = [(1, c) for c in (5, 40, 63, 64, 100, 17, 250, 1, 129, 77, 31, 200)] + [(20, 33)]
    rng = np.random.default_rng(21)
    pool = BlockPool(num_blocks, seed=9)
    chunks = [(list(range(q)), ctx, pool.take(blocks_for(q + ctx, block_size))) for q, ctx in specs]
    total = sum(q for q, _ in specs)
    q = paddle.to_tensor(rng.standard_normal((total, heads, head_dim)).astype(np.float32))
    k = paddle.to_tensor(rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)).astype(np.float32))
    v = paddle.to_tensor(rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)).astype(np.float32))
    if cache_dtype == "bfloat16":
        k, v = k.astype("bfloat16"), v.astype("bfloat16")
    scale = head_dim**-0.5

    def attend(meta, rows):
        step = (paddle.to_tensor(meta.query_start_loc), paddle.to_tensor(meta.seq_lens), paddle.to_tensor(meta.block_tables))
        return cpu_kernels.fd_paged_attention(rows, k, v, *step, scale, 0, path).numpy()

    meta = build_meta(chunks, block_size)
    batch = attend(meta, q)
    want = ReferenceOps().paged_attention(q, k.astype("float32"), v.astype("float32"), meta, scale, None)
    tol = 1e-4 if cache_dtype == "float32" else 2e-2  # the bfloat16 formula rounds queries and weights
    np.testing.assert_allclose(batch.reshape(want.shape), want.numpy(), rtol=tol, atol=tol)
    start = 0
    for chunk, (q_len, _) in zip(chunks, specs):
        alone = attend(build_meta([chunk], block_size), q[start : start + q_len])
        np.testing.assert_array_equal(batch[start : start + q_len], alone)
        start += q_len


@pytest.mark.parametrize("specs", [[(1, 2000)], [(64, 1900)]], ids=["decode", "prompt_chunk"])
def test_online_softmax_when_the_maximum_keeps_rising(specs, cpu_kernels):
    """Keys whose scores grow along the sequence (and spread over ~100 units): every key tile
    raises a row's running maximum, so each rescales the partial sums and outputs before it; a
    wrong rescale or a split combined with the wrong weights shows at once."""
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 32, 16, 300
    rng = np.random.default_rng(11)
    pool = BlockPool(num_blocks, seed=5)
    chunks = [(list(range(q)), ctx, pool.take(blocks_for(q + ctx, block_size))) for q, ctx in specs]
    meta = build_meta(chunks, block_size)
    total = sum(q for q, _ in specs)
    q = np.abs(rng.standard_normal((total, heads, head_dim))).astype(np.float32)
    k = np.abs(rng.standard_normal((num_blocks, block_size, kv_heads, head_dim))).astype(np.float32)
    for b, (q_len, ctx) in enumerate(specs):  # scale each key by its position in its sequence
        for i in range(blocks_for(q_len + ctx, block_size)):
            positions = np.arange(i * block_size, (i + 1) * block_size, dtype=np.float32)
            k[meta.block_tables[b][i]] *= (positions / 700.0).reshape(block_size, 1, 1)
    v = rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    for window in (0, 300):
        want = ReferenceOps().paged_attention(
            paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(v), meta, 1.0, window or None
        )
        out = _attend(cpu_kernels, paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(v), meta, 1.0, window)
        np.testing.assert_allclose(out.numpy().reshape(want.shape), want.numpy(), rtol=1e-4, atol=1e-5)


def test_kernels_reject_out_of_range_slots_positions_and_blocks(cpu_kernels):
    meta, qkv, (k0, v0) = _case([(2, 3)])
    table = paddle.to_tensor(cos_sin_cache(D, 4).astype(np.float32))  # positions 3 and 4: 4 is outside
    k, v = paddle.to_tensor(k0), paddle.to_tensor(v0)
    with pytest.raises(Exception, match="outside the rotary table"):
        cpu_kernels.fd_rope_write_kv(paddle.to_tensor(qkv), meta.positions, table, k, v, meta.slot_mapping, HEADS, KV_HEADS)
    big_table = paddle.to_tensor(cos_sin_cache(D, 64).astype(np.float32))
    bad_slots = paddle.to_tensor(np.array([0, NB * BS], dtype=np.int64))
    with pytest.raises(Exception, match="outside the cache"):
        cpu_kernels.fd_rope_write_kv(paddle.to_tensor(qkv), meta.positions, big_table, k, v, bad_slots, HEADS, KV_HEADS)
    tables = np.array(meta.block_tables)
    tables[0, 0] = NB  # one past the last block
    q = paddle.zeros([2, HEADS, D])
    with pytest.raises(Exception, match="outside the cache's"):
        cpu_kernels.fd_paged_attention(
            q,
            k,
            v,
            paddle.to_tensor(meta.query_start_loc),
            paddle.to_tensor(meta.seq_lens),
            paddle.to_tensor(tables),
            1.0,
            0,
            0,
        )
    with pytest.raises(Exception, match="sliding_window must be >= 0"):
        cpu_kernels.fd_paged_attention(
            q,
            k,
            v,
            paddle.to_tensor(meta.query_start_loc),
            paddle.to_tensor(meta.seq_lens),
            paddle.to_tensor(meta.block_tables),
            1.0,
            -1,
            0,
        )
    with pytest.raises(Exception, match="not a multiple"):
        cpu_kernels.fd_paged_attention(
            paddle.zeros([2, 4, D]),
            k,
            v,
            paddle.to_tensor(meta.query_start_loc),
            paddle.to_tensor(meta.seq_lens),
            paddle.to_tensor(meta.block_tables),
            1.0,
            0,
            0,
        )


def test_cpu_ops_declare_ragged_attention_only_with_their_kernels(cpu_kernels):
    """The scheduler mixes prompt chunks and decodes in one step only when attention is ragged:
    the cpu table's kernels are; its int8-KV wrapper (the reference composition) is not."""
    from fastdeploy_core.engine.engine_core import mixes_prefill_and_decode
    from fastdeploy_core.builtin.cpu.ops import CpuOps
    from fastdeploy_core.quantization.kv_cache import Int8KVCacheQuantizer

    ops = CpuOps()
    assert ops.ragged_attention is True and mixes_prefill_and_decode(ops)
    wrapped = Int8KVCacheQuantizer().wrap_ops(ops)
    assert wrapped.ragged_attention is False and not mixes_prefill_and_decode(wrapped)
    assert not mixes_prefill_and_decode(ReferenceOps())


def test_norm_and_swiglu_kernels_check_their_inputs(cpu_kernels):
    x = paddle.ones([2, 8])
    with pytest.raises(Exception, match="weight must have the hidden size 8"):
        cpu_kernels.fd_rms_norm(x, paddle.ones([7]), 1e-6)
    with pytest.raises(Exception, match="residual must be float32 shaped like x"):
        cpu_kernels.fd_add_rms_norm(x, paddle.ones([2, 7]), paddle.ones([8]), 1e-6)
    with pytest.raises(Exception, match="must hold gate and up halves"):
        cpu_kernels.fd_silu_mul(paddle.ones([2, 7]))
    out = cpu_kernels.fd_silu_mul(paddle.to_tensor(np.array([[0.0, 1.0, 2.0, 3.0]], dtype=np.float32)))
    np.testing.assert_allclose(out.numpy(), [[0.0 * 2.0, 3.0 / (1.0 + np.exp(-1.0))]], rtol=1e-6)


@pytest.mark.parametrize("rows,cols", [(1, 49152), (64, 49152), (5, 15), (3, 17), (2, 1)])
def test_argmax_kernel_takes_the_first_largest_value_of_each_row(rows, cols, cpu_kernels):
    """``fd_argmax`` (greedy sampling) against numpy: planted ties before and after each row's
    maximum, including ties inside one vector lane and across lanes; NaN never wins over a number."""
    rng = np.random.default_rng(rows * 1000 + cols)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    top = x.argmax(axis=-1)
    for r in range(rows):
        for at in {int(rng.integers(0, cols)), min(cols - 1, int(top[r]) + 16), max(0, int(top[r]) - 16)}:
            x[r, at] = x[r, top[r]]
    out = cpu_kernels.fd_argmax(paddle.to_tensor(x)).numpy()
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, x.argmax(axis=-1))
    if cols > 1:
        y = x.copy()
        y[:, 0] = np.nan  # lane 0 starts at NaN: the row's real maximum must still be found
        want = np.nanargmax(y, axis=-1)
        np.testing.assert_array_equal(cpu_kernels.fd_argmax(paddle.to_tensor(y)).numpy(), want)
    with pytest.raises(Exception, match="float32 logits"):
        cpu_kernels.fd_argmax(paddle.to_tensor(x[0]))
