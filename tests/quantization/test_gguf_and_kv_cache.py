"""GGUF blocks into quantized storage without a float round trip, and the int8 KV cache."""

from __future__ import annotations

import os
from typing import ClassVar

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.builtin.cpu.ops import CpuOps
from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.executor.forward_meta import ForwardMeta
from fastdeploy_core.layers.linear import Linear, QKVLinear
from fastdeploy_core.loader.gguf_blocks import GGUFBlocks
from fastdeploy_core.quantization.gguf import q4_to_int4, q8_0_to_int8
from fastdeploy_core.layers.kv_layout import KVCacheLayout
from fastdeploy_core.quantization.kv_cache import (
    Int8KVCacheOps,
    Int8KVCacheQuantizer,
    QuantizedKVCache,
    dequantize_kv,
    quantize_kv,
)
from fastdeploy_core.quantization.weight_only import WeightOnlyInt4, WeightOnlyInt8, int4_weight, int8_weight

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants


def _gguf_tensor(type_name: str, shape=(96, 128), seed=0):
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    t = GGMLQuantizationType[type_name]
    data = quants.quantize(w, t)
    exact = quants.dequantize(data, t).reshape(shape).astype(np.float32)
    return GGUFBlocks(type_name, data, shape), exact


def test_q8_0_blocks_become_int8_storage_exactly():
    blocks, exact = _gguf_tensor("Q8_0")
    out = q8_0_to_int8(blocks)
    assert out["weight"].dtype == np.int8 and out["weight"].shape == (128, 96)
    assert out["weight_scale"].shape == (4, 96)
    deq = int8_weight(paddle.to_tensor(out["weight"]), paddle.to_tensor(out["weight_scale"]), 32).numpy()
    np.testing.assert_array_equal(deq, exact.T)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_q4_blocks_become_int4_storage_exactly(type_name):
    blocks, exact = _gguf_tensor(type_name)
    out = q4_to_int4(blocks)
    assert out["weight"].shape == (64, 96) and out["weight_scale"].shape == (4, 96)
    deq = int4_weight(*(paddle.to_tensor(out[k]) for k in ("weight", "weight_scale", "weight_offset")), 32).numpy()
    np.testing.assert_allclose(deq, exact.T, rtol=0, atol=1e-6 * np.abs(exact).max())


def test_unpermuting_blocks_matches_unpermuting_floats():
    from fd_llama.gguf import interleaved_rope_order

    def _unpermute(weight, num_heads):  # the float formula: heads, pairs, halves swapped back
        rows = weight.shape[0]
        return weight.reshape(num_heads, rows // num_heads // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)

    blocks, exact = _gguf_tensor("Q8_0", shape=(64, 64))
    unpermuted = blocks.permute_rows(interleaved_rope_order(64, 4))
    np.testing.assert_array_equal(unpermuted.dequantize(), _unpermute(exact, 4))


def test_gguf_blocks_load_into_layers_through_the_weight_loader():
    q8, q8_exact = _gguf_tensor("Q8_0", shape=(32, 64), seed=1)
    q41, q41_exact = _gguf_tensor("Q4_1", shape=(32, 64), seed=2)
    x = paddle.to_tensor(np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32))
    set_current_ops(CpuOps())
    int8 = WeightOnlyInt8().for_gguf({"Q8_0"})
    layer = Linear(64, 32, quant_config=int8, prefix="a.o_proj")
    layer.weight.weight_loader(layer.weight, q8)
    np.testing.assert_allclose(layer(x).numpy(), x.numpy() @ q8_exact.T, rtol=1e-5, atol=1e-5)
    int4 = WeightOnlyInt4().for_gguf({"Q4_1"})
    layer = Linear(64, 32, quant_config=int4, prefix="a.o_proj")
    layer.weight.weight_loader(layer.weight, q41)
    np.testing.assert_allclose(layer(x).numpy(), x.numpy() @ q41_exact.T, rtol=1e-5, atol=1e-5)
    # storage that cannot hold the blocks as stored requantizes from their float values
    per_channel = Linear(64, 32, quant_config=WeightOnlyInt8(), prefix="a.o_proj")
    per_channel.weight.weight_loader(per_channel.weight, q41)
    assert per_channel.weight_scale.shape == [1, 32]
    err = np.abs(per_channel(x).numpy() - x.numpy() @ q41_exact.T).max() / np.abs(x.numpy() @ q41_exact.T).max()
    assert 0 < err < 0.02


def test_gguf_blocks_with_a_wrong_size_are_rejected():
    with pytest.raises(ModelLoadError, match="holds 10 bytes"):
        GGUFBlocks("Q8_0", np.zeros(10, np.uint8), (1, 32))
    with pytest.raises(ModelLoadError, match="cannot be taken directly"):
        GGUFBlocks("Q6_K", np.zeros(10, np.uint8), (1, 256))


def test_block_filter_picks_quantized_linear_weights_by_hf_name():
    class Tiny(paddle.nn.Layer):
        packed_modules_mapping: ClassVar[dict] = {
            "q_proj": ("qkv_proj", "q"),
            "k_proj": ("qkv_proj", "k"),
            "v_proj": ("qkv_proj", "v"),
        }

        def __init__(self, quantizer):
            super().__init__()
            self.qkv_proj = QKVLinear(64, 16, 4, 2, quant_config=quantizer, prefix="qkv_proj")
            self.o_proj = Linear(64, 64, prefix="o_proj")  # left in float32

    quantizer = WeightOnlyInt4().for_gguf({"Q4_1"})
    keep = quantizer.gguf_block_filter(Tiny(quantizer))
    assert keep("q_proj.weight", "Q4_1") and keep("v_proj.weight", "Q4_0")
    assert not keep("q_proj.weight", "Q8_0")  # int4 storage does not hold Q8_0 blocks
    assert not keep("o_proj.weight", "Q4_1")  # not quantized
    assert not keep("q_proj.bias", "Q4_1")


# ---- KV cache int8 ------------------------------------------------------------------------------
def test_kv_quantization_error_is_within_half_a_step_per_head():
    x = paddle.to_tensor(np.random.default_rng(4).standard_normal((5, 3, 64)).astype(np.float32))
    codes, scale = quantize_kv(x)
    assert codes.dtype == paddle.int8 and scale.shape == [5, 3, 1]
    err = paddle.abs(dequantize_kv(codes, scale) - x)
    assert bool((err <= scale * 0.5 + 1e-7).all())
    np.testing.assert_allclose(scale.numpy()[..., 0], np.abs(x.numpy()).max(-1) / 127, rtol=1e-6)


def _paged_case(seed: int):
    """Two sequences in scattered blocks: one decoding (ctx 9), one prefilling 3 tokens after 4 cached."""
    rng = np.random.default_rng(seed)
    block, kvh, d, heads = 4, 2, 16, 4
    seq_lens = np.array([10, 7])
    query_start = np.array([0, 1, 4])
    tables = np.array([[5, 1, 7], [2, 6, 0]])
    # seq 0 writes position 9, seq 1 positions 4..6
    slots = np.array(
        [tables[0][9 // block] * block + 9 % block] + [tables[1][p // block] * block + p % block for p in (4, 5, 6)]
    )
    meta = ForwardMeta(
        input_ids=None,
        positions=None,
        slot_mapping=paddle.to_tensor(slots),
        query_start_loc=query_start,
        seq_lens=seq_lens,
        block_tables=tables,
        block_size=block,
        logits_indices=None,
    )
    history = rng.standard_normal((8, block, kvh, d)).astype(np.float32)  # already cached contexts
    q = paddle.to_tensor(rng.standard_normal((4, heads, d)).astype(np.float32))
    k_new = paddle.to_tensor(rng.standard_normal((4, kvh, d)).astype(np.float32))
    v_new = paddle.to_tensor(rng.standard_normal((4, kvh, d)).astype(np.float32))
    return meta, history, q, k_new, v_new, (8, block, kvh, d)


def test_int8_kv_cache_attention_is_close_to_float_attention():
    meta, history, q, k_new, v_new, shape = _paged_case(5)
    ref = ReferenceOps()
    k_f, v_f = paddle.to_tensor(history), paddle.to_tensor(history * 0.5)
    ref.write_kv_cache(k_new, v_new, k_f, v_f, meta.slot_mapping)
    want = ref.paged_attention(q, k_f, v_f, meta, 0.25).numpy()

    kv = Int8KVCacheQuantizer()
    blocks, block, kvh, d = shape
    (k_q, v_q), = kv.allocate_layout(KVCacheLayout.key_value(1, kvh, d), blocks, block)
    assert isinstance(k_q, QuantizedKVCache) and k_q.data.dtype == paddle.int8
    all_slots = paddle.arange(8 * 4)
    k_q.index_put_((all_slots // 4, all_slots % 4), paddle.to_tensor(history.reshape(32, 2, 16)))
    v_q.index_put_((all_slots // 4, all_slots % 4), paddle.to_tensor((history * 0.5).reshape(32, 2, 16)))
    ops = kv.wrap_ops(ReferenceOps())
    ops.write_kv_cache(k_new, v_new, k_q, v_q, meta.slot_mapping)
    meta.attn_state.clear()
    got = ops.paged_attention(q, k_q, v_q, meta, 0.25).numpy()
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < err < 0.02, err
    # the written slots hold the quantized new keys
    np.testing.assert_allclose(
        k_q.dequantize().numpy().reshape(32, 2, 16)[meta.slot_mapping.numpy()], k_new.numpy(), atol=0.02
    )
    # every op but the cache's own is the wrapped table's, unchanged
    assert ops.rms_norm == ops.inner.rms_norm
    assert k_q.nbytes == 8 * 4 * 2 * (16 + 4)


def test_int8_kv_cache_bytes_per_token():
    assert Int8KVCacheQuantizer.bytes_per_token(3, 64) == 3 * 68  # vs 3 * 64 * 4 in float32


def test_wrapper_passes_float_caches_through():
    meta, history, q, k_new, v_new, _ = _paged_case(6)
    k_f, v_f = paddle.to_tensor(history), paddle.to_tensor(history)
    ops = Int8KVCacheOps(ReferenceOps())
    ReferenceOps().write_kv_cache(k_new, v_new, k_f, v_f, meta.slot_mapping)
    got = ops.paged_attention(q, k_f, v_f, meta, 0.25).numpy()
    meta.attn_state.clear()
    want = ReferenceOps().paged_attention(q, k_f, v_f, meta, 0.25).numpy()
    np.testing.assert_array_equal(got, want)


# ---- int8 token embedding --------------------------------------------------------------------------
def test_int8_embedding_rows_are_within_half_a_step():
    from fastdeploy_core.layers.embedding import VocabEmbedding

    table = np.random.default_rng(7).standard_normal((50, 64)).astype(np.float32)
    emb = VocabEmbedding(50, 64, WeightOnlyInt8(), prefix="model.embed_tokens")
    assert emb.weight.dtype == paddle.int8 and emb.weight_scale.shape == [50, 2]  # groups of 32
    emb.weight.weight_loader(emb.weight, table)
    ids = paddle.to_tensor([3, 0, 49, 3])
    got = emb(ids).numpy()
    step = np.repeat(emb.weight_scale.numpy(), 32, axis=1)[[3, 0, 49, 3]]
    assert np.all(np.abs(got - table[[3, 0, 49, 3]]) <= 0.5 * step * (1 + 1e-5))
    float_emb = VocabEmbedding(50, 64, None)
    assert float_emb.quant_method is None and float_emb.weight.dtype == paddle.float32
    assert VocabEmbedding(50, 64, WeightOnlyInt8({"embedding_quant_type": None})).quant_method is None


def test_q8_0_embedding_loads_exactly():
    from fastdeploy_core.layers.embedding import VocabEmbedding

    blocks, exact = _gguf_tensor("Q8_0", shape=(40, 96), seed=8)
    emb = VocabEmbedding(40, 96, WeightOnlyInt4(), prefix="model.embed_tokens")
    emb.weight.weight_loader(emb.weight, blocks)
    np.testing.assert_array_equal(emb(paddle.arange(40)).numpy(), exact)


def test_block_filter_keeps_a_tied_embedding_as_blocks_only_when_the_head_takes_them():
    from fastdeploy_core.layers.embedding import LMHead, VocabEmbedding

    class Tied(paddle.nn.Layer):
        def __init__(self, quantizer):
            super().__init__()
            self.embed_tokens = VocabEmbedding(64, 32, quantizer, prefix="embed_tokens")
            self.lm_head = LMHead(64, 32, quant_config=quantizer)

    keep = WeightOnlyInt8().gguf_block_filter(Tied(WeightOnlyInt8()))
    assert keep("embed_tokens.weight", "Q8_0") and not keep("embed_tokens.weight", "Q4_1")
    float_head = WeightOnlyInt8({"lm_head_quant_type": None})
    assert not float_head.gguf_block_filter(Tied(float_head))("embed_tokens.weight", "Q8_0")
