"""Tiny random Qwen2 / Qwen3 checkpoints written by transformers: our models give the same tokens.

Each case saves a random transformers model with ``save_pretrained`` (safetensors); our model
must give transformers' 32 greedy tokens and its last-position logits (within 1e-4) for each
prompt alone, batched with chunked prefill, on a prefix-cache hit (reference ops, paged
harness) and through the engine (batched, chunked, prefix-cache hits, preemption).
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest
import torch
import transformers
from fd_qwen.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.loader import load_model_weights, resolve_model_source
from fastdeploy_core.plugins import load_plugins
from fastdeploy_core.testing.model_parity import check_engine, check_paged, hf_reference

pytestmark = pytest.mark.usefixtures("restore_ops")

BASE = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.25,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

#: name -> (transformers config class, model class, our class, config overrides)
CASES = {
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen2_sliding_window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1, "rope_theta": 1000.0},
    ),
    "qwen3_untied": ("Qwen3Config", "Qwen3ForCausalLM", Qwen3ForCausalLM, {"head_dim": 24}),
    "qwen3_attention_bias": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        Qwen3ForCausalLM,
        {"head_dim": 16, "attention_bias": True, "tie_word_embeddings": True},
    ),
    "qwen3_moe_renormalized": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        Qwen3MoeForCausalLM,
        {
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    "qwen3_moe_sparse_step_mlp_only": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        Qwen3MoeForCausalLM,
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": False,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
            "tie_word_embeddings": True,
        },
    ),
}

PROMPTS = [[1, 5, 17, 33, 8, 60, 42], [1, 90, 3], [1, 7, 7, 7, 12, 55, 81, 23, 4, 19, 66]]
NEW_TOKENS = 32


def _checkpoint(tmp_path_factory, name: str):
    config_cls, model_cls, ours, extra = CASES[name]
    torch.manual_seed(1234)
    hf_model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**BASE, **extra})).eval()
    path = str(tmp_path_factory.mktemp(name))
    hf_model.save_pretrained(path, safe_serialization=True)
    return path, hf_model, ours


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    path, hf_model, ours = _checkpoint(tmp_path_factory, request.param)
    return request.param, path, ours, hf_reference(hf_model, PROMPTS, NEW_TOKENS)


def _load(path: str, cls):
    source = resolve_model_source(path)
    model = cls(source.hf_config)
    model.eval()
    load_model_weights(model, source)
    return model


def test_paged_tokens_and_logits_match_transformers(case):
    _name, path, ours, references = case
    set_current_ops(ReferenceOps())
    check_paged(_load(path, ours), PROMPTS, NEW_TOKENS, references)


def test_engine_tokens_match_transformers(case):
    _name, path, ours, references = case
    target, impl, _ = load_plugins().model_provider(ours.__name__, "auto", resolve_model_source(path).hf_config)
    assert impl == "fastdeploy" and target == f"fd_qwen.qwen:{ours.__name__}"
    check_engine(path, PROMPTS, NEW_TOKENS, references)


def test_the_window_and_the_qk_norm_change_the_tokens(tmp_path_factory):
    """Without Qwen2's window or Qwen3's per-head norm the same weights give other tokens, so the
    tests above can fail."""
    set_current_ops(ReferenceOps())
    for name, switch in (("qwen2_sliding_window", "window"), ("qwen3_untied", "qk_norm")):
        path, hf_model, ours = _checkpoint(tmp_path_factory, name)
        references = hf_reference(hf_model, PROMPTS, NEW_TOKENS)
        model = _load(path, ours)
        for layer in model.sublayers():
            if switch == "window" and hasattr(layer, "sliding_window"):
                layer.sliding_window = None
            if switch == "qk_norm" and hasattr(layer, "q_norm"):
                layer.q_norm = layer.k_norm = None
        with pytest.raises(AssertionError):
            check_paged(model, PROMPTS, NEW_TOKENS, references)


def test_sliding_window_layers_follow_max_window_layers():
    config = {**BASE, "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}
    windows = [layer.self_attn.attn.sliding_window for layer in Qwen2ForCausalLM(config).model.layers]
    assert windows == [None, 5, 5]
    off = Qwen2ForCausalLM({**config, "use_sliding_window": False})
    assert [layer.self_attn.attn.sliding_window for layer in off.model.layers] == [None, None, None]
    with pytest.raises(ModelLoadError, match="layer_types lists 2 layers"):
        Qwen3ForCausalLM({**config, "layer_types": ["full_attention", "sliding_attention"]})


def test_moe_layers_follow_sparse_step_and_mlp_only_layers():
    _, _, _, extra = CASES["qwen3_moe_sparse_step_mlp_only"]
    model = Qwen3MoeForCausalLM({**BASE, **extra})
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["GatedMLP", "SparseMoeBlock", "GatedMLP", "GatedMLP"]


def test_contradicting_moe_fields_are_load_errors(tmp_path_factory):
    _, _, _, extra = CASES["qwen3_moe_renormalized"]
    with pytest.raises(ModelLoadError, match="3 experts per token .* of 2 experts"):
        Qwen3MoeForCausalLM({**BASE, **extra, "num_experts": 2, "num_experts_per_tok": 3})
    path, _, _ = _checkpoint(tmp_path_factory, "qwen3_moe_renormalized")
    source = resolve_model_source(path)
    narrow = Qwen3MoeForCausalLM({**source.hf_config, "moe_intermediate_size": 16})
    with pytest.raises(ModelLoadError, match=r"experts\.\d+\.(gate|up|down)_proj\.weight.*moe_intermediate_size"):
        load_model_weights(narrow, source)
    fewer = Qwen3MoeForCausalLM({**source.hf_config, "num_experts": 4, "num_local_experts": 4})
    with pytest.raises(ModelLoadError, match="expert [4-7].*num_experts"):
        load_model_weights(fewer, source)
