"""Tiny random ERNIE-4.5 checkpoints (dense and MoE) written by transformers: our models give
the same tokens.

Each case saves a random transformers model with ``save_pretrained`` (safetensors, the ``-PT``
layout); our model must give transformers' 32 greedy tokens and its last-position logits
(within 1e-4) for each prompt alone, batched with chunked prefill, on a prefix-cache hit
(reference ops, paged harness) and through the engine (batched, chunked, prefix-cache hits,
preemption).
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import pytest
import torch
import transformers
from fd_ernie.ernie import (
    Ernie4_5_MoeForCausalLM,
    Ernie4_5ForCausalLM,
    adjacent_to_half_rotation,
    paddle_to_hf_tensors,
)

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
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.25,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
MOE = {"moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 32}

#: name -> (transformers config class, model class, our class, config overrides)
CASES = {
    "ernie_dense_tied": ("Ernie4_5Config", "Ernie4_5ForCausalLM", Ernie4_5ForCausalLM, {}),
    "ernie_dense_bias_untied": (
        "Ernie4_5Config",
        "Ernie4_5ForCausalLM",
        Ernie4_5ForCausalLM,
        {"use_bias": True, "tie_word_embeddings": False, "head_dim": 24},
    ),
    "ernie_moe_shared": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        Ernie4_5_MoeForCausalLM,
        {**MOE, "moe_num_shared_experts": 1, "moe_layer_start_index": 1},
    ),
    "ernie_moe_interval_no_shared": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        Ernie4_5_MoeForCausalLM,
        {
            **MOE,
            "num_hidden_layers": 4,
            "moe_num_experts": 4,
            "moe_num_shared_experts": 0,
            "moe_layer_start_index": 0,
            "moe_layer_interval": 2,
            "tie_word_embeddings": False,
        },
    ),
}

PROMPTS = [[1, 5, 17, 33, 8, 60, 42], [1, 90, 3], [1, 7, 7, 7, 12, 55, 81, 23, 4, 19, 66]]
NEW_TOKENS = 32


def _checkpoint(tmp_path_factory, name: str):
    config_cls, model_cls, ours, extra = CASES[name]
    torch.manual_seed(2024)  # a seed whose 32-token runs have no float32 near-tie between top logits
    hf_model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**BASE, **extra})).eval()
    with torch.no_grad():  # random correction biases, so that they change some expert choices
        for module in hf_model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.05)
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
    _, path, ours, references = case
    set_current_ops(ReferenceOps())
    check_paged(_load(path, ours), PROMPTS, NEW_TOKENS, references)


def test_engine_tokens_match_transformers(case):
    _, path, ours, references = case
    target, impl, _ = load_plugins().model_provider(ours.__name__, "auto", resolve_model_source(path).hf_config)
    assert impl == "fastdeploy" and target == f"fd_ernie.ernie:{ours.__name__}"
    check_engine(path, PROMPTS, NEW_TOKENS, references)


def test_rotation_reorder_and_correction_bias_matter(tmp_path_factory):
    """Without the Q/K row reorder, or without the router's correction bias, the same weights
    give other tokens, so the tests above can fail."""
    set_current_ops(ReferenceOps())
    path, hf_model, _ = _checkpoint(tmp_path_factory, "ernie_moe_shared")
    references = hf_reference(hf_model, PROMPTS, NEW_TOKENS)

    class NoReorder(Ernie4_5_MoeForCausalLM):
        def checkpoint_tensors(self, name, array):
            yield name.replace(".mlp.moe_statics.", ".mlp."), array

    with pytest.raises(AssertionError):
        check_paged(_load(path, NoReorder), PROMPTS, NEW_TOKENS, references)
    model = _load(path, Ernie4_5_MoeForCausalLM)
    for layer in model.sublayers():
        if getattr(layer, "e_score_correction_bias", None) is not None:
            layer.e_score_correction_bias.set_value(np.zeros(layer.e_score_correction_bias.shape, np.float32))
    with pytest.raises(AssertionError):
        check_paged(model, PROMPTS, NEW_TOKENS, references)


def test_moe_layers_follow_start_end_interval():
    _, _, _, extra = CASES["ernie_moe_interval_no_shared"]
    kinds = [type(layer.mlp).__name__ for layer in Ernie4_5_MoeForCausalLM({**BASE, **extra}).model.layers]
    assert kinds == ["GatedMLP", "SparseMoeBlock", "GatedMLP", "SparseMoeBlock"]
    bounded = Ernie4_5_MoeForCausalLM({**BASE, **extra, "moe_layer_interval": 1, "moe_layer_end_index": 2})
    assert [type(layer.mlp).__name__ for layer in bounded.model.layers] == [
        "SparseMoeBlock",
        "SparseMoeBlock",
        "SparseMoeBlock",
        "GatedMLP",
    ]


def test_contradicting_moe_fields_are_load_errors(tmp_path_factory):
    with pytest.raises(ModelLoadError, match="9 experts per token .* of 8 experts"):
        Ernie4_5_MoeForCausalLM({**BASE, **MOE, "moe_k": 9})
    path, _, _ = _checkpoint(tmp_path_factory, "ernie_moe_shared")
    source = resolve_model_source(path)
    with pytest.raises(ModelLoadError, match=r"experts\.\d+\.(gate|up|down)_proj\.weight.*moe_intermediate_size"):
        load_model_weights(Ernie4_5_MoeForCausalLM({**source.hf_config, "moe_intermediate_size": 16}), source)
    with pytest.raises(
        ModelLoadError, match=r"experts\.[67]\..*the config declares 6 experts \(num_experts / moe_num_experts\)"
    ):
        load_model_weights(Ernie4_5_MoeForCausalLM({**source.hf_config, "moe_num_experts": 6}), source)


def test_adjacent_to_half_rotation_order():
    assert adjacent_to_half_rotation(8, 4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def _to_paddle_layout(hf_dir: str, paddle_dir: str, hf_config: dict) -> None:
    """Write the HF checkpoint in ``hf_dir`` again in the Paddle (``-Paddle`` repo) layout.

    The mapping is PaddleFormers' ERNIE-4.5 layout as its ``ernie4_5``/``ernie4_5_moe`` modeling
    and ``_get_tensor_parallel_mappings`` define it: ``base_model_prefix = "ernie"``;
    ``paddle.nn.Linear`` weights ``[in, out]``; ``self_attn.qkv_proj`` = Q, K, V concatenated on
    the output axis (split back as ``[num_heads, num_kv_heads, num_kv_heads]`` heads);
    ``mlp.up_gate_proj`` = gate then up on the output axis (``gate, up = chunk(2, -1)``) in MLPs,
    experts and shared experts; the router ``mlp.gate`` and an MTP layer's ``mtp_linear_proj``
    ``[in, out]`` like the other linear weights; embedding, LM head
    and ``moe_statics.e_score_correction_bias`` as HF stores them.
    """
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    hf = {}
    for file in sorted(os.listdir(hf_dir)):
        if file.endswith(".safetensors"):
            hf.update(load_file(os.path.join(hf_dir, file)))
    out = {}
    for name, array in hf.items():
        paddle_name = "ernie." + name[len("model.") :] if name.startswith("model.") else name
        leaf = name.rsplit(".", 1)[1]
        if ".self_attn.q_proj." in name:
            parts = [hf[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            fused = np.concatenate(parts, axis=0)
            out[paddle_name.replace("q_proj", "qkv_proj")] = fused.T.copy() if leaf == "weight" else fused
        elif ".gate_proj." in name:
            fused = np.concatenate([array, hf[name.replace("gate_proj", "up_proj")]], axis=0)
            out[paddle_name.replace("gate_proj", "up_gate_proj")] = fused.T.copy() if leaf == "weight" else fused
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name or ".up_proj." in name:
            continue  # fused above
        elif name.endswith(("o_proj.weight", "down_proj.weight", "mlp.gate.weight")) or ".mtp_linear_proj." in name:
            out[paddle_name] = array.T.copy()
        else:
            out[paddle_name] = array
    os.makedirs(paddle_dir, exist_ok=True)
    save_file(out, os.path.join(paddle_dir, "model.safetensors"))
    with open(os.path.join(paddle_dir, "config.json"), "w") as f:
        json.dump(hf_config, f)
    assert any(n.endswith("qkv_proj.weight") for n in out) and all(n.startswith(("ernie.", "lm_head.")) for n in out)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(hf_dir, extra)):
            shutil.copy(os.path.join(hf_dir, extra), paddle_dir)


@pytest.mark.parametrize("name", ["ernie_dense_bias_untied", "ernie_moe_shared"])
def test_paddle_layout_loads_the_same_weights_and_tokens(tmp_path_factory, name):
    """A checkpoint in the Paddle layout (fused QKV and gate/up, ``[in, out]`` weights, ``ernie.``
    names) loads into exactly the parameters the HF layout gives, and so into the same tokens."""
    set_current_ops(ReferenceOps())
    path, hf_model, ours = _checkpoint(tmp_path_factory, name)
    paddle_path = str(tmp_path_factory.mktemp(f"{name}_paddle"))
    _to_paddle_layout(path, paddle_path, resolve_model_source(path).hf_config)
    from_hf, from_paddle = _load(path, ours), _load(paddle_path, ours)
    hf_params = dict(from_hf.named_parameters())
    for param_name, param in from_paddle.named_parameters():
        np.testing.assert_array_equal(param.numpy(), hf_params[param_name].numpy(), err_msg=param_name)
    check_paged(from_paddle, PROMPTS, NEW_TOKENS, hf_reference(hf_model, PROMPTS, NEW_TOKENS))


def test_paddle_fused_qkv_of_the_wrong_width_is_a_load_error():
    dims = Ernie4_5ForCausalLM(BASE).dims
    with pytest.raises(ModelLoadError, match=r"ernie\.layers\.0\.self_attn\.qkv_proj\.weight.*implies 128 outputs"):
        list(paddle_to_hf_tensors("ernie.layers.0.self_attn.qkv_proj.weight", np.zeros((64, 96), np.float32), dims))
