"""Speculative decoding with ERNIE-4.5's multi-token-prediction layer (``method: mtp``).

Tiny random ERNIE-4.5 checkpoints (dense, and MoE whose MTP block is dense as in the released
ones) with one MTP layer saved in ERNIE's names (``model.mtp_emb_norm.0``, ``mtp_hidden_norm.0``,
``mtp_linear_proj.0``, ``mtp_block.0``). transformers has no ERNIE MTP module, so the reference
is its generic ``MtpLayer`` built from ``Ernie4_5DecoderLayer`` with the post norm set to the main
model's final norm: FastDeploy's ``Ernie4_5_MTPModel`` (``enorm``/``hnorm``, ``eh_proj`` over
``[embedding, hidden]``, the block, then the shared ``ernie.norm``). Our ``forward_mtp`` gives
its logits over a paged cache; the Paddle layout loads the same parameters; through the engine
``mtp`` leaves every token as it is without speculation, and in a model built so that the MTP
layer must agree with the target every draft is accepted (which fails if the output norm, the
order of the projection's input or the token fed were wrong).
"""

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import pytest
import torch
import transformers
from fd_ernie.ernie import Ernie4_5_MoeForCausalLM, Ernie4_5ForCausalLM
from safetensors.torch import load_file, save_file
from test_ernie_tiny_configs import BASE, MOE, PROMPTS, _load, _to_paddle_layout

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.engine.engine_core import EngineCore
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.testing.engine_run import run_to_end
from fastdeploy_core.testing.mtp import check_forward_mtp, zero_block_outputs
from fastdeploy_core.loader import resolve_model_source

pytestmark = pytest.mark.usefixtures("restore_ops")

MTP = {"method": "mtp", "num_speculative_tokens": 3}
MORE_PROMPTS = [*PROMPTS, [1, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57], [1, 12, 12, 12, 12, 30]]

#: name -> (transformers config class, model class, config overrides)
CASES = {
    "dense_tied": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {}),
    "moe_untied": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        {**MOE, "moe_num_shared_experts": 1, "moe_layer_start_index": 1, "tie_word_embeddings": False},
    ),
}


def _hf_modules(config_cls: str):
    module = "ernie4_5_moe" if "Moe" in config_cls else "ernie4_5"
    modeling = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=["x"])
    prefix = "Ernie4_5_Moe" if "Moe" in config_cls else "Ernie4_5"
    return getattr(modeling, f"{prefix}DecoderLayer"), getattr(modeling, f"{prefix}RMSNorm")


def _save_with_mtp(tmp_path_factory, name: str, tag: str):
    """The transformers model of case ``name`` plus one random MTP layer, saved in ERNIE's names:
    (path, the HF model, the reference MTP layer)."""
    from transformers.modeling_layers import MtpLayer

    config_cls, model_cls, extra = CASES[name]
    torch.manual_seed(2024)
    hf_model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**BASE, **extra})).eval()
    path = str(tmp_path_factory.mktemp(f"ernie_mtp_{name}_{tag}"))
    hf_model.save_pretrained(path, safe_serialization=True)
    decoder_layer, norm = _hf_modules(config_cls)
    torch.manual_seed(99)
    mtp = MtpLayer(hf_model.config, decoder_layer, norm, 0).eval()  # layer 0: a dense block
    with torch.no_grad():
        for value in mtp.state_dict().values():
            if value.is_floating_point():
                value.copy_(torch.randn_like(value) * 0.2)
        mtp.post_norm.weight.copy_(hf_model.model.norm.weight)  # the shared final norm
    tensors = {}
    for key, value in mtp.state_dict().items():
        if key.startswith("post_norm."):
            continue  # not stored: the main model's norm
        for ours, theirs in (("enorm.", "mtp_emb_norm.0."), ("hnorm.", "mtp_hidden_norm.0."),
                             ("eh_proj.", "mtp_linear_proj.0."), ("mtp_block.", "mtp_block.0.")):
            if key.startswith(ours):
                tensors["model." + theirs + key[len(ours):]] = value.detach().clone().contiguous()
    assert len(tensors) == len(mtp.state_dict()) - 1
    file = os.path.join(path, "model.safetensors")
    save_file({**load_file(file), **tensors}, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path, hf_model, mtp


@pytest.fixture(scope="module", params=sorted(CASES))
def with_mtp(request, tmp_path_factory):
    return (request.param, *_save_with_mtp(tmp_path_factory, request.param, "random"))


def _our_class(path: str):
    with open(os.path.join(path, "config.json")) as f:
        return Ernie4_5_MoeForCausalLM if "moe_num_experts" in json.load(f) else Ernie4_5ForCausalLM


# ---- the layer itself ------------------------------------------------------------------------
def test_forward_mtp_matches_the_reference_layer(with_mtp):
    """Rows 0-4 in one prefill chunk, then 5-7 one at a time over the paged cache (block size 4,
    blocks out of order), against the reference's logits; a layer normalised by a norm of its
    own instead of the main model's would not match."""
    name, path, hf_model, hf_mtp = with_mtp
    set_current_ops(ReferenceOps())
    model = _load(path, _our_class(path))
    assert model.num_mtp_layers == 1 and model.mtp_layers[0].shared_head is None
    check_forward_mtp(model, hf_model, hf_mtp)


def test_paddle_layout_loads_the_same_mtp_parameters(with_mtp, tmp_path_factory):
    """``ernie.mtp_*`` names, the block's fused QKV and gate/up, ``[in, out]`` projections."""
    name, path, _, _ = with_mtp
    set_current_ops(ReferenceOps())
    paddle_path = str(tmp_path_factory.mktemp(f"ernie_mtp_{name}_paddle"))
    _to_paddle_layout(path, paddle_path, resolve_model_source(path).hf_config)
    cls = _our_class(path)
    from_hf, from_paddle = _load(path, cls), _load(paddle_path, cls)
    hf_params = dict(from_hf.named_parameters())
    names = [n for n, _ in from_paddle.named_parameters() if n.startswith("mtp_layers.0.")]
    assert "mtp_layers.0.eh_proj.weight" in names and any("qkv_proj" in n for n in names)
    for param_name, param in from_paddle.named_parameters():
        np.testing.assert_array_equal(param.numpy(), hf_params[param_name].numpy(), err_msg=param_name)


def test_missing_mtp_tensors_name_the_switch(with_mtp, tmp_path_factory):
    name, path, _, _ = with_mtp
    tensors = load_file(os.path.join(path, "model.safetensors"))
    cut = str(tmp_path_factory.mktemp(f"ernie_mtp_{name}_cut"))
    save_file({k: v for k, v in tensors.items() if "mtp_linear_proj" not in k}, os.path.join(cut, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f, open(os.path.join(cut, "config.json"), "w") as g:
        g.write(f.read())
    with pytest.raises(ModelLoadError, match=r"num_nextn_predict_layers=1 .*mtp_layers\.0\.eh_proj\.weight"):
        _load(cut, _our_class(cut))


# ---- through the engine ----------------------------------------------------------------------
def _core(path: str, spec: dict | None, **kw) -> EngineCore:
    settings = {"model": path, "max_model_len": 64, "block_size": 4, "num_gpu_blocks_override": 96, **kw}
    if spec:
        settings["speculative_config"] = spec
    return EngineCore(EngineArgs.create(**settings))


def _run(core: EngineCore, requests) -> dict:
    return run_to_end(core, requests)


def _batch(max_tokens: int = 20) -> list:
    return [(f"g{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(MORE_PROMPTS)]


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 5}], ids=["plain", "chunked"])
def test_mtp_tokens_equal_no_speculation(with_mtp, settings):
    path = with_mtp[1]
    off = _run(_core(path, None, **settings), _batch())
    core = _core(path, MTP, **settings)
    assert _run(core, _batch()) == off
    stats = core.get_stats()
    assert stats["spec_decode_method"] == "mtp" and stats["spec_decode_num_draft_tokens_total"] > 0, stats


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    """A dense checkpoint whose MTP layer must guess what the target computes next: every
    attention output and feed-forward projection is zero, so the target's hidden state at a
    position is the final norm of its token's embedding; ``mtp_linear_proj`` passes the
    normalised embedding half through and drops the hidden half, ``mtp_emb_norm`` is all ones,
    and the shared final norm makes the layer's output for the token at ``p + 1`` the target's
    hidden state at ``p + 1``. (With the hidden half first, a norm of its own, or the token at
    ``p``, it would guess wrong.)"""
    path, hf_model, _ = _save_with_mtp(tmp_path_factory, "dense_tied", "agreeing")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    hidden = hf_model.config.hidden_size
    zero_block_outputs(tensors)
    tensors["model.mtp_linear_proj.0.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    tensors["model.mtp_emb_norm.0.weight"] = torch.ones(hidden)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def test_an_agreeing_mtp_layer_has_every_draft_accepted(agreeing):
    off = _run(_core(agreeing, None), _batch())
    core = _core(agreeing, MTP)
    assert _run(core, _batch()) == off
    stats = core.get_stats()
    proposed, accepted = stats["spec_decode_num_draft_tokens_total"], stats["spec_decode_num_accepted_tokens_total"]
    assert proposed > 0 and accepted == proposed, stats
    assert stats["spec_decode_mean_accepted_length"] > 2.5


def test_the_mtp_cache_is_budgeted_with_the_targets(with_mtp):
    """Under ``--kv-cache-memory`` each block holds the target's rows and the MTP layer's: 3
    decoder layers + 1 MTP layer of 2 KV heads x 16 floats (K and V) per token, block size 4."""
    path = with_mtp[1]
    budget = 1 << 20
    per_layer_block = 4 * 2 * 2 * 16 * 4  # tokens x (K, V) x heads x head_dim x float32 bytes
    off = _core(path, None, num_gpu_blocks_override=None, kv_cache_memory=budget)
    on = _core(path, MTP, num_gpu_blocks_override=None, kv_cache_memory=budget)
    assert off.runner.num_blocks == budget // (3 * per_layer_block)
    assert on.runner.num_blocks == budget // (4 * per_layer_block)
    assert on.runner.bytes_per_block == 4 * per_layer_block
    caches = on.runner._mtp_kv_caches  # allocated with the target's, before any request
    assert caches is not None and len(caches) == 1 and caches[0][0].shape[0] == on.runner.num_blocks
    assert off.runner._mtp_kv_caches is None
    assert _run(on, _batch(8)) == _run(off, _batch(8))
