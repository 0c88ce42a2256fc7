"""The cpu kernels over a bfloat16 KV cache (``--kv-cache-dtype bfloat16``).

Attention reads a bfloat16 cache by widening each key tile's K and V rows to float32 and
running the float32 tile code on them (queries stay float32); that is the one path, on every
x86 CPU. So the kernels are held to exact statements:

* ``fd_rope_write_kv`` into a bfloat16 cache stores the round-to-nearest-even bfloat16 of what
  it stores into a float32 cache (the same rotated keys, the same values), bit for bit;
* ``fd_paged_attention`` over a bfloat16 cache gives, bit for bit, what it gives over a float32
  cache holding the widened values, at short and long (thousands of keys, split over threads)
  contexts;
* the fused op and the cpu ops table agree with the reference ops on bfloat16 caches (the
  conformance kit's ``check_bf16_kv_cache``, short and >= 2k-token scenarios).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.builtin.cpu.device import CpuDevice
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


@pytest.mark.parametrize("specs", list(SPECS.values()), ids=list(SPECS))
@pytest.mark.parametrize("window", [0, 300])
def test_bf16_cache_is_the_rounded_float32_cache_bit_for_bit(specs, window, cpu_kernels):
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

    # Attention over the bfloat16 cache = attention over its widened float32 copy, bit for bit.
    got = cpu_kernels.fd_paged_attention(bq, bk, bv, *_step(meta), scale, window)
    wk, wv = paddle.to_tensor(widen(bits_of(bk))), paddle.to_tensor(widen(bits_of(bv)))
    want = cpu_kernels.fd_paged_attention(bq, wk, wv, *_step(meta), scale, window)
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    # ... and not what the unrounded float32 cache gives (the rounding is really read).
    unrounded = cpu_kernels.fd_paged_attention(fq, fk, fv, *_step(meta), scale, window)
    assert not np.array_equal(got.numpy(), unrounded.numpy())

    # The fused op: both steps in one call, the same caches and output.
    ck, cv = bf16_tensor(k_bits), bf16_tensor(v_bits)
    fused = cpu_kernels.fd_rope_paged_attention(
        paddle.to_tensor(qkv), meta.positions, table, ck, cv, meta.slot_mapping, *_step(meta),
        HEADS, KV_HEADS, scale, window,
    )
    np.testing.assert_array_equal(fused.numpy(), got.numpy().reshape(fused.shape))
    np.testing.assert_array_equal(bits_of(ck), bits_of(bk))
    np.testing.assert_array_equal(bits_of(cv), bits_of(bv))


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
