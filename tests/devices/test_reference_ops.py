"""ReferenceOps against plain numpy formulas: paged attention in every batch shape, KV writes,
RoPE (incl. Llama-3 scaling vs transformers), norms and activations."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.layers.rotary import build_cos_sin_cache, compute_inv_freq, rope_settings
from fastdeploy_core.testing.paged_harness import build_meta

H, KVH, D = 6, 2, 8
BLOCK = 4


def dense_causal_attention(q, k, v, scale):
    """q [L, h, d] of the LAST L positions of a context k/v [S, kvh, d]; numpy reference."""
    seq, group = k.shape[0], q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    first = seq - q.shape[0]
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = first + np.arange(q.shape[0])
    scores = np.where(np.arange(seq)[None, None, :] <= q_pos[None, :, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v)


class Sequence:
    def __init__(self, rng, length, blocks):
        self.k = rng.standard_normal((length, KVH, D)).astype(np.float32)
        self.v = rng.standard_normal((length, KVH, D)).astype(np.float32)
        self.q = rng.standard_normal((length, H, D)).astype(np.float32)
        self.blocks = blocks


def run_step(ops, caches, seqs, spans):
    """One step: sequence i contributes positions spans[i] = (start, stop); returns per-seq outputs."""
    chunks = [(list(range(start, stop)), start, s.blocks) for s, (start, stop) in zip(seqs, spans)]
    meta = build_meta(chunks, BLOCK)
    q = np.concatenate([s.q[a:b] for s, (a, b) in zip(seqs, spans)])
    k = np.concatenate([s.k[a:b] for s, (a, b) in zip(seqs, spans)])
    v = np.concatenate([s.v[a:b] for s, (a, b) in zip(seqs, spans)])
    ops.write_kv_cache(paddle.to_tensor(k), paddle.to_tensor(v), caches[0], caches[1], meta.slot_mapping)
    out = ops.paged_attention(paddle.to_tensor(q), caches[0], caches[1], meta, D**-0.5).numpy()
    assert "paged_reference" in meta.attn_state  # derived tensors built once, reused by later layers
    result, row = [], 0
    for s, (a, b) in zip(seqs, spans):
        result.append(out[row : row + b - a])
        expected = dense_causal_attention(s.q[a:b], s.k[:b], s.v[:b], D**-0.5)
        np.testing.assert_allclose(out[row : row + b - a], expected, atol=2e-5, rtol=1e-5)
        row += b - a
    return result


def new_caches(num_blocks=32):
    return paddle.zeros([num_blocks, BLOCK, KVH, D]), paddle.zeros([num_blocks, BLOCK, KVH, D])


def test_prefill_in_chunks_equals_dense_attention():
    ops, caches, rng = ReferenceOps(), new_caches(), np.random.default_rng(0)
    seq = Sequence(rng, 13, [7, 2, 30, 11])
    for span in [(0, 5), (5, 6), (6, 13)]:
        run_step(ops, caches, [seq], [span])


def test_prefill_over_prefix_cached_blocks():
    """Blocks 0-1 of the context were filled earlier (prefix cache): attend over them without recomputing."""
    ops, caches, rng = ReferenceOps(), new_caches(), np.random.default_rng(1)
    seq = Sequence(rng, 11, [3, 9, 4])
    flat_k, flat_v = caches[0].reshape([-1, KVH, D]), caches[1].reshape([-1, KVH, D])
    for pos in range(8):  # as if another request had computed them
        slot = seq.blocks[pos // BLOCK] * BLOCK + pos % BLOCK
        flat_k[slot] = paddle.to_tensor(seq.k[pos])
        flat_v[slot] = paddle.to_tensor(seq.v[pos])
    run_step(ops, caches, [seq], [(8, 11)])


def test_mixed_prefill_and_decode_batch():
    ops, caches, rng = ReferenceOps(), new_caches(), np.random.default_rng(2)
    long = Sequence(rng, 10, [1, 5, 12])
    fresh = Sequence(rng, 6, [20, 21])
    middle = Sequence(rng, 9, [8, 0, 14])
    run_step(ops, caches, [long, middle], [(0, 9), (0, 4)])  # prefill + partial prefill
    run_step(ops, caches, [long, fresh, middle], [(9, 10), (0, 6), (4, 9)])  # decode + prefill + chunk


def test_decode_only_batch_with_different_lengths_and_single_sequence():
    ops, caches, rng = ReferenceOps(), new_caches(), np.random.default_rng(3)
    seqs = [Sequence(rng, n, blocks) for n, blocks in [(5, [2, 3]), (9, [4, 6, 7]), (8, [10, 11])]]
    run_step(ops, caches, seqs, [(0, 4), (0, 8), (0, 7)])
    run_step(ops, caches, seqs, [(4, 5), (8, 9), (7, 8)])  # all query_lens == 1
    run_step(ReferenceOps(), caches, [seqs[2]], [(7, 8)])  # B=1, context exactly fills 2 blocks


def test_write_kv_cache_is_in_place_at_slots():
    ops = ReferenceOps()
    k_cache, v_cache = new_caches(4)
    k = paddle.to_tensor(np.arange(3 * KVH * D, dtype=np.float32).reshape(3, KVH, D))
    slots = paddle.to_tensor(np.array([13, 2, 7], dtype=np.int64))
    ops.write_kv_cache(k, -k, k_cache, v_cache, slots)
    kc = k_cache.numpy().reshape(-1, KVH, D)
    np.testing.assert_array_equal(kc[[13, 2, 7]], k.numpy())
    np.testing.assert_array_equal(v_cache.numpy().reshape(-1, KVH, D)[[13, 2, 7]], -k.numpy())
    assert np.count_nonzero(np.delete(kc, [13, 2, 7], axis=0)) == 0


def test_rotary_equals_rotate_half_formula():
    ops, rng = ReferenceOps(), np.random.default_rng(4)
    cache = build_cos_sin_cache(D, 64, 10000.0, None)
    positions = np.array([0, 3, 17, 63], dtype=np.int64)
    q = rng.standard_normal((4, H, D)).astype(np.float32)
    k = rng.standard_normal((4, KVH, D)).astype(np.float32)
    qr, kr = ops.rotary_embedding(paddle.to_tensor(positions), paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(cache))
    inv = 1.0 / (10000.0 ** (np.arange(0, D, 2) / D))
    ang = positions[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]

    def rotate_half(x):
        return np.concatenate([-x[..., D // 2 :], x[..., : D // 2]], -1)

    np.testing.assert_allclose(qr.numpy(), q * cos + rotate_half(q) * sin, atol=1e-5)
    np.testing.assert_allclose(kr.numpy(), k * cos + rotate_half(k) * sin, atol=1e-5)


@pytest.mark.parametrize(
    "parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        },
    ],
)
def test_inv_freq_matches_transformers(parameters):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=dict(parameters))
    if parameters["rope_type"] == "default":
        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](config, None)
    theta, scaling = rope_settings(config.to_dict())
    np.testing.assert_allclose(compute_inv_freq(128, theta, scaling), expected.numpy(), rtol=1e-6)


def test_rope_settings_reads_transformers4_keys():
    theta, scaling = rope_settings({"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert theta == 500000.0 and scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert rope_settings({"rope_theta": 10.0, "rope_scaling": None}) == (10.0, None)


def test_norms_activation_linear_embedding():
    ops, rng = ReferenceOps(), np.random.default_rng(5)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    r = rng.standard_normal((3, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)

    def rms(a):
        return a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6) * w

    np.testing.assert_allclose(ops.rms_norm(paddle.to_tensor(x), paddle.to_tensor(w), 1e-6).numpy(), rms(x), atol=1e-5)
    normed, summed = ops.add_rms_norm(paddle.to_tensor(x), paddle.to_tensor(r), paddle.to_tensor(w), 1e-6)
    np.testing.assert_allclose(summed.numpy(), x + r, atol=1e-6)
    np.testing.assert_allclose(normed.numpy(), rms(x + r), atol=1e-5)
    first, residual = ops.add_rms_norm(paddle.to_tensor(x), None, paddle.to_tensor(w), 1e-6)
    np.testing.assert_allclose(first.numpy(), rms(x), atol=1e-5)
    np.testing.assert_array_equal(residual.numpy(), x)

    gate_up = rng.standard_normal((3, 8)).astype(np.float32)
    gate, up = gate_up[:, :4], gate_up[:, 4:]
    expected = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(ops.silu_and_mul(paddle.to_tensor(gate_up)).numpy(), expected, atol=1e-6)

    weight = rng.standard_normal((16, 5)).astype(np.float32)
    bias = rng.standard_normal(5).astype(np.float32)
    np.testing.assert_allclose(ops.linear(paddle.to_tensor(x), paddle.to_tensor(weight)).numpy(), x @ weight, atol=1e-5)
    np.testing.assert_allclose(
        ops.linear(paddle.to_tensor(x), paddle.to_tensor(weight), paddle.to_tensor(bias)).numpy(), x @ weight + bias, atol=1e-5
    )
    table = rng.standard_normal((10, 4)).astype(np.float32)
    ids = np.array([3, 0, 9, 3])
    np.testing.assert_array_equal(ops.embedding(paddle.to_tensor(ids), paddle.to_tensor(table)).numpy(), table[ids])


def test_long_prefill_is_attended_in_query_chunks():
    """A tiny score budget forces the query-chunked path; results must not change."""
    ops, caches, rng = ReferenceOps(), new_caches(), np.random.default_rng(6)
    ops.max_score_elements = 2 * 2 * H * 24  # 2 sequences x 24 cache slots: 2 query rows per chunk
    a = Sequence(rng, 21, [0, 4, 8, 12, 16, 20])
    b = Sequence(rng, 9, [1, 5, 9])
    run_step(ops, caches, [a, b], [(0, 11), (0, 9)])
    run_step(ops, caches, [a, b], [(11, 21), (8, 9)])


def test_write_kv_cache_reaches_numpy_backed_caches():
    """The cpu model runner allocates caches as numpy buffers shared through DLPack."""
    buffers = [np.zeros((4, BLOCK, KVH, D), np.float32) for _ in range(2)]
    k_cache, v_cache = (paddle.utils.dlpack.from_dlpack(b) for b in buffers)
    k = paddle.ones([2, KVH, D])
    ReferenceOps().write_kv_cache(k, k * 2, k_cache, v_cache, paddle.to_tensor(np.array([1, 6], dtype=np.int64)))
    assert buffers[0].reshape(-1, KVH, D)[[1, 6]].sum() == 2 * KVH * D
    assert buffers[1].sum() == 4 * KVH * D
