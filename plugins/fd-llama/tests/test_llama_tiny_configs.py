"""Tiny random Llama checkpoints written by transformers: our model gives the same tokens.

Each case saves a random ``LlamaForCausalLM`` with ``save_pretrained`` (safetensors), loads it
through ``resolve_model_source`` + ``load_model_weights`` and compares prompt logits and greedy
tokens with transformers' own forward/generate on torch CPU.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import pytest
import torch
from fd_llama.llama import LlamaForCausalLM
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from fastdeploy_core.loader import load_model_weights, resolve_model_source
from fastdeploy_core.testing.paged_harness import PagedHarness
from tests.support.reference import hf_greedy

BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.25,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

CASES = {
    "gqa_tied": dict(tie_word_embeddings=True, rope_theta=10000.0),
    "llama3_rope_untied": dict(
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "linear_rope_mha_explicit_head_dim": dict(
        tie_word_embeddings=False,
        num_key_value_heads=4,
        head_dim=24,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    "gqa_one_kv_head_bias": dict(num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True),
}

PROMPTS = [[1, 5, 17, 33, 8, 60, 42], [1, 90, 3], [1, 7, 7, 7, 12, 55, 81, 23, 4, 19, 66]]
NEW_TOKENS = 12


def _hf_checkpoint(tmp_path_factory, name: str):
    torch.manual_seed(1234)
    config = LlamaConfig(**{**BASE, **CASES[name]})
    model = HFLlama(config).eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path)


def _hf_greedy(model, prompt: list[int]) -> tuple[np.ndarray, list[int]]:
    return hf_greedy(model, prompt, NEW_TOKENS)


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    hf_model, path = _hf_checkpoint(tmp_path_factory, request.param)
    source = resolve_model_source(path)
    assert source.format == "hf" and source.architecture == "LlamaForCausalLM"
    model = LlamaForCausalLM(source.hf_config)
    model.eval()
    load_model_weights(model, source)
    references = [_hf_greedy(hf_model, p) for p in PROMPTS]
    return request.param, model, references


@pytest.mark.parametrize("block_size,prefill_chunk", [(16, None), (3, 5)])
def test_batched_greedy_tokens_and_logits_match_transformers(pair, block_size, prefill_chunk):
    """All prompts in one batch (prefill and decode mixed); block size 3 and 5-token chunks put
    chunk and block boundaries at odd places."""
    name, model, references = pair
    blocks_per_seq = -(-(max(map(len, PROMPTS)) + NEW_TOKENS) // block_size)
    num_blocks = blocks_per_seq * len(PROMPTS) + 1
    rng = np.random.default_rng(7)
    order = rng.permutation(num_blocks).tolist()
    tables = [order[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(len(PROMPTS))]
    harness = PagedHarness(model, num_blocks=num_blocks, block_size=block_size)
    generated, first_logits = harness.generate(PROMPTS, NEW_TOKENS, tables, prefill_chunk=prefill_chunk)
    for (ref_logits, ref_tokens), tokens, logits in zip(references, generated, first_logits):
        assert tokens == ref_tokens, name
        np.testing.assert_allclose(logits, ref_logits, atol=2e-4, rtol=1e-4)


def test_kv_cache_spec_follows_config(pair):
    name, model, _ = pair
    config = {**BASE, **CASES[name]}
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    assert model.kv_cache_spec() == (config["num_hidden_layers"], config["num_key_value_heads"], head_dim)


def test_sharded_safetensors_checkpoint_loads_like_one_file(tmp_path):
    torch.manual_seed(5)
    hf_model = HFLlama(LlamaConfig(**{**BASE, **CASES["gqa_tied"]})).eval()
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) > 1
    source = resolve_model_source(str(tmp_path))
    model = LlamaForCausalLM(source.hf_config)
    load_model_weights(model, source)
    logits = PagedHarness(model, num_blocks=2, block_size=16).step([(PROMPTS[0], 0, [1])])[0]
    ref_logits, _ = _hf_greedy(hf_model, PROMPTS[0])
    np.testing.assert_allclose(logits, ref_logits, atol=2e-4, rtol=1e-4)
