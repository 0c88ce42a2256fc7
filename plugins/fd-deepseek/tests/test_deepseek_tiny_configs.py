"""Tiny random DeepSeek-V3 checkpoints written by transformers: our model gives the same tokens.

Each case saves a random transformers ``DeepseekV3ForCausalLM`` (2-3 layers, the first dense,
experts in 2 groups, ``q_lora_rank`` set and none, YaRN and plain rope, interleaved and plain
rotary pairs, random router correction biases); our model must give transformers' 32 greedy
tokens and its last-position logits (within 1e-4) alone, batched with chunked prefill, on a
prefix-cache hit (paged harness) and through the engine (batched, chunked, prefix-cache hits,
preemption). The cache holds one latent row per token; the absorbed decode equals the expanded
form; the MTP layer's tensors load into ``mtp_layers`` and missing ones are named.
"""

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest
import torch
import transformers
from fd_deepseek.deepseek import DeepseekV3ForCausalLM, DeepseekV3MoE
from safetensors.torch import load_file, save_file

from fastdeploy_core.devices.current import current_ops, set_current_ops
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.errors import ConfigError, ModelLoadError
from fastdeploy_core.layers.decoder import GatedMLP
from fastdeploy_core.layers.kv_layout import kv_cache_layout
from fastdeploy_core.loader import load_model_weights, resolve_model_source
from fastdeploy_core.plugins import load_plugins
from fastdeploy_core.testing.model_parity import check_engine, check_paged, hf_reference
from fastdeploy_core.testing.paged_harness import PagedHarness

pytestmark = pytest.mark.usefixtures("restore_ops")

BASE = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.25,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "num_mtp_layers": 0,
}

CASES = {
    # q through a low-rank pair, YaRN with distinct mscales (cos/sin factor and softmax scale
    # both differ from plain rope), interleaved rotary pairs, 8 experts, the best 1 of 2 groups.
    "q_lora_yarn_interleaved": {
        "num_hidden_layers": 3,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 24,
        "n_routed_experts": 8,
        "topk_group": 1,
        "num_experts_per_tok": 3,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rope_interleave": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.7,
        },
    },
    # q from one projection, plain rope in rotate-half order, biases on the attention
    # projections, 4 experts in 2 groups, two shared experts, unnormalised weights.
    "q_proj_plain_rope": {
        "num_hidden_layers": 2,
        "q_lora_rank": None,
        "kv_lora_rank": 24,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "topk_group": 2,
        "num_experts_per_tok": 2,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.5,
        "rope_interleave": False,
        "attention_bias": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
    },
}

PROMPTS = [[1, 5, 17, 33, 8, 60, 42], [1, 90, 3], [1, 7, 7, 7, 12, 55, 81, 23, 4, 19, 66]]
NEW_TOKENS = 32


def _hf_model(name: str):
    torch.manual_seed(1234)
    config = transformers.DeepseekV3Config(**{**BASE, **CASES[name]})
    config._attn_implementation = "eager"
    hf_model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # transformers starts the correction biases at zero: make them choose
        for layer in hf_model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(config.n_routed_experts))
    return hf_model


def _checkpoint(tmp_path_factory, name: str):
    hf_model = _hf_model(name)
    path = str(tmp_path_factory.mktemp(name))
    hf_model.save_pretrained(path, safe_serialization=True)
    return path, hf_model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    path, hf_model = _checkpoint(tmp_path_factory, request.param)
    return request.param, path, hf_reference(hf_model, PROMPTS, NEW_TOKENS)


def _load(path: str, cls=DeepseekV3ForCausalLM, **overrides):
    source = resolve_model_source(path)
    model = cls({**source.hf_config, **overrides})
    model.eval()
    load_model_weights(model, source)
    return model


def test_paged_tokens_and_logits_match_transformers(case):
    _name, path, references = case
    set_current_ops(ReferenceOps())
    check_paged(_load(path), PROMPTS, NEW_TOKENS, references)


def test_engine_tokens_match_transformers(case):
    _name, path, references = case
    target, impl, _ = load_plugins().model_provider(
        "DeepseekV3ForCausalLM", "auto", resolve_model_source(path).hf_config
    )
    assert impl == "fastdeploy" and target == "fd_deepseek.deepseek:DeepseekV3ForCausalLM"
    check_engine(path, PROMPTS, NEW_TOKENS, references)


def test_kv_cache_holds_one_latent_row_per_token(case):
    """KV bytes per token are the latent size (kv_lora_rank + qk_rope_head_dim floats per layer),
    not per-head K and V; the engine's runner allocates and reports exactly that."""
    from fastdeploy_core.config import EngineArgs
    from fastdeploy_core.engine.engine_core import EngineCore

    name, path, _ = case
    cfg = {**BASE, **CASES[name]}
    layers, latent = cfg["num_hidden_layers"], cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    core = EngineCore(EngineArgs.create(model=path, max_model_len=64, block_size=4, num_gpu_blocks_override=32))
    runner = core.runner
    assert runner.bytes_per_block == layers * 4 * latent * 4
    spec = runner.describe()["kv_cache_spec"]
    assert spec == {
        "num_layers": layers,
        "kind": "latent",
        "token_shapes": [[1, latent]],
        "bytes_per_token_per_layer": 4 * latent,
        "mtp_layers": 0,
        "dtype": "float32",
    }
    per_head_kv = 2 * cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) * 4
    print(f"{name}: KV bytes per token per layer {4 * latent} (latent) vs {per_head_kv} (expanded K/V)")
    assert 4 * latent < per_head_kv
    assert len(runner.kv_caches) == layers
    assert all(len(c) == 1 and list(c[0].shape) == [32, 4, 1, latent] for c in runner.kv_caches)


class _BothForms(ReferenceOps):
    """The reference table computing every latent attention in both forms; it records how far
    apart they are and how many decode rows were compared."""

    def __init__(self):
        super().__init__()
        self.max_difference, self.decode_rows = 0.0, 0

    def mla_paged_attention(self, q, latent, latent_cache, meta, w_kv, scale, form="auto"):
        expanded = super().mla_paged_attention(q, latent, latent_cache, meta, w_kv, scale, "expanded")
        absorbed = super().mla_paged_attention(q, latent, latent_cache, meta, w_kv, scale, "absorbed")
        difference = float(paddle.max(paddle.abs(expanded - absorbed)))
        self.max_difference = max(self.max_difference, difference)
        self.decode_rows += int(meta.is_decode_only) * int(q.shape[0])
        return absorbed if meta.is_decode_only else expanded


def test_absorbed_decode_equals_expanded_form(case):
    """Every latent attention of a batched, chunked generation (the model's real activations
    and caches) computed both ways: the absorbed form equals the expanded one within 1e-5."""
    _name, path, references = case
    ops = _BothForms()
    set_current_ops(ops)
    model = _load(path)
    harness = PagedHarness(model, num_blocks=40, block_size=4)
    tables = [list(range(1 + 13 * i, 14 + 13 * i)) for i in range(len(PROMPTS))]
    generated, _ = harness.generate(PROMPTS, 16, tables, prefill_chunk=4)
    assert ops.decode_rows > 0
    assert ops.max_difference < 1e-5, ops.max_difference
    assert [g for g in generated] == [ref[1][:16] for ref in references]


def test_interleaving_and_mscale_change_the_tokens(tmp_path_factory):
    """Without the rotary reorder or YaRN's softmax mscale the same weights give other tokens,
    so the parity tests above can fail."""
    path, hf_model = _checkpoint(tmp_path_factory, "q_lora_yarn_interleaved")
    references = hf_reference(hf_model, PROMPTS, NEW_TOKENS)
    set_current_ops(ReferenceOps())
    with pytest.raises(AssertionError):
        check_paged(_load(path, rope_interleave=False), PROMPTS, NEW_TOKENS, references)
    model = _load(path)
    for layer in model.model.layers:
        layer.self_attn.dims.softmax_scale = layer.self_attn.dims.qk_head_dim**-0.5
    with pytest.raises(AssertionError):
        check_paged(model, PROMPTS, NEW_TOKENS, references)


def test_first_k_dense_layers_then_moe():
    model = DeepseekV3ForCausalLM({**BASE, **CASES["q_lora_yarn_interleaved"], "first_k_dense_replace": 2})
    assert [type(layer.mlp) for layer in model.model.layers] == [GatedMLP, GatedMLP, DeepseekV3MoE]
    assert kv_cache_layout(model).bytes_per_token() == 4 * (32 + 8)


def test_inconsistent_mla_dimensions_are_load_errors(tmp_path_factory):
    config = {**BASE, **CASES["q_proj_plain_rope"]}
    with pytest.raises(ModelLoadError, match="qk_head_dim 20 is not qk_nope_head_dim 8 \\+ qk_rope_head_dim 8"):
        DeepseekV3ForCausalLM({**config, "qk_head_dim": 20})
    with pytest.raises(ModelLoadError, match="missing 'kv_lora_rank'"):
        DeepseekV3ForCausalLM({k: v for k, v in config.items() if k != "kv_lora_rank"})
    with pytest.raises(ModelLoadError, match="qk_rope_head_dim 7 must be even"):
        DeepseekV3ForCausalLM({**config, "qk_rope_head_dim": 7})
    path, _ = _checkpoint(tmp_path_factory, "q_proj_plain_rope")
    with pytest.raises(ModelLoadError, match=r"self_attn\.kv_a_layernorm\.weight.*\(24,\).*\(16,\)"):
        _load(path, kv_lora_rank=16)
    with pytest.raises(ModelLoadError, match=r"kv_b_proj\.weight.*qk_nope_head_dim \+ v_head_dim"):
        _load(path, v_head_dim=8)


def add_mtp_layer(path: str, hf_model, count: int = 1):
    """Save ``count`` random transformers ``MtpLayer`` s into the checkpoint at ``path`` (of
    ``hf_model``) as ``model.layers.{N + k}`` in DeepSeek's names, and set
    ``num_nextn_predict_layers``: (the tensors added, the first HF MTP layer holding the same values)."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    tensors = {}
    layers = []
    for k in range(count):
        torch.manual_seed(99 + k)
        mtp = MtpLayer(hf_model.config.get_mtp_config(), DeepseekV3DecoderLayer, DeepseekV3RMSNorm, 0).eval()
        with torch.no_grad():  # every tensor, the fused experts' too (MtpLayer leaves those uninitialised)
            for value in mtp.state_dict().values():
                if value.is_floating_point():
                    value.copy_(torch.randn_like(value) * 0.2)
        layers.append(mtp)
        first = hf_model.config.num_hidden_layers + k
        for key, value in mtp.state_dict().items():
            key = key.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
            prefix = f"model.layers.{first}.{key.rsplit('.', 1)[0]}"
            if key.endswith("experts.gate_up_proj"):  # transformers' in-memory layout -> DeepSeek's per-expert names
                for e, gate_up in enumerate(value):
                    gate, up = gate_up.chunk(2, dim=0)
                    tensors[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                    tensors[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
            elif key.endswith("experts.down_proj"):
                for e, down in enumerate(value):
                    tensors[f"{prefix}.{e}.down_proj.weight"] = down.contiguous()
            else:
                tensors[f"model.layers.{first}.{key}"] = value.detach().clone().contiguous()
        tensors[f"model.layers.{first}.embed_tokens.weight"] = hf_model.model.embed_tokens.weight.detach().clone()
        tensors[f"model.layers.{first}.shared_head.head.weight"] = hf_model.lm_head.weight.detach().clone()
    file = os.path.join(path, "model.safetensors")
    save_file({**load_file(file), **tensors}, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = count
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return tensors, layers[0]


def _mtp_checkpoint(tmp_path_factory, name: str) -> tuple[str, dict]:
    """The checkpoint of ``name`` plus one MTP layer at ``model.layers.{N}`` in DeepSeek's names."""
    path, hf_model = _checkpoint(tmp_path_factory, name)
    tensors, _ = add_mtp_layer(path, hf_model)
    return path, tensors


def test_mtp_layer_weights_load_and_are_exposed(tmp_path_factory):
    path, tensors = _mtp_checkpoint(tmp_path_factory, "q_lora_yarn_interleaved")
    set_current_ops(ReferenceOps())  # loaded and run on one ops table
    model = _load(path)
    first = model.dims.num_layers
    assert model.num_mtp_layers == 1 and len(model.mtp_layers) == 1
    mtp = model.mtp_layers[0]
    np.testing.assert_array_equal(mtp.enorm.weight.numpy(), tensors[f"model.layers.{first}.enorm.weight"].numpy())
    np.testing.assert_array_equal(
        mtp.shared_head.norm.weight.numpy(), tensors[f"model.layers.{first}.shared_head.norm.weight"].numpy()
    )
    plain = current_ops().unprepare_linear_weight  # the ops table may have packed weights for its kernels
    np.testing.assert_array_equal(
        plain(mtp.eh_proj.weight).numpy(), tensors[f"model.layers.{first}.eh_proj.weight"].numpy().T
    )
    assert isinstance(mtp.mlp, DeepseekV3MoE)  # an MTP layer is MoE whatever first_k_dense_replace says
    np.testing.assert_array_equal(
        plain(mtp.mlp.experts.w2_weight).numpy()[3], tensors[f"model.layers.{first}.mlp.experts.3.down_proj.weight"].numpy().T
    )
    kv_b = tensors[f"model.layers.{first}.self_attn.kv_b_proj.weight"].numpy()  # [h * (dn + dv), L]
    np.testing.assert_array_equal(mtp.self_attn.kv_b_proj.weight.numpy()[1].T, kv_b[40:80])
    # The MTP layer is not part of the target model's cache or forward.
    assert kv_cache_layout(model).num_layers == first
    # And the target model still matches transformers (which ignores the MTP tensors).
    hf_model = _hf_model("q_lora_yarn_interleaved")
    check_paged(model, PROMPTS[:1], 8, hf_reference(hf_model, PROMPTS[:1], 8))


def test_missing_mtp_tensors_are_named(tmp_path_factory):
    path, _ = _checkpoint(tmp_path_factory, "q_proj_plain_rope")
    with pytest.raises(
        ModelLoadError, match=r"num_nextn_predict_layers=1 .*lacks \d+ of their tensors, e\.g\. model\.layers\.2\."
    ):
        _load(path, num_nextn_predict_layers=1)
    path, _ = _mtp_checkpoint(tmp_path_factory, "q_proj_plain_rope")
    file = os.path.join(path, "model.safetensors")
    kept = {k: v for k, v in load_file(file).items() if not k.startswith("model.layers.2.eh_proj")}
    save_file(kept, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks 1 of their tensors, e\.g\. model\.layers\.2\.eh_proj\.weight;"):
        _load(path)


def test_int8_latent_cache_stores_codes_and_reads_the_same_from_cache(case):
    """``--kv-cache-dtype int8`` with a latent cache: each token's latent row is stored as int8
    codes plus a scale for the latent and one for the rotary key (L + dr + 8 bytes per layer
    instead of 4 (L + dr)); a step reads the
    new rows as later steps will, so chunked prefill and prefix-cache hits give the tokens of
    one whole prompt step, and the first step's log-probabilities stay near the float cache's."""
    from fastdeploy_core.config import EngineArgs
    from fastdeploy_core.engine.engine_core import EngineCore
    from fastdeploy_core.engine.outputs import EngineCoreRequest
    from fastdeploy_core.engine.sampling_params import SamplingParams
    from fastdeploy_core.quantization.kv_cache import QuantizedKVCache

    name, path, _ = case
    cfg = {**BASE, **CASES[name]}
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]

    def core(**kw):
        return EngineCore(EngineArgs.create(model=path, max_model_len=64, block_size=4, num_gpu_blocks_override=32, **kw))

    def generate(engine, prompt, rid):
        engine.add_request(EngineCoreRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                         logprobs=3)))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return [t for o in outs for t in o.new_token_ids], outs[0].new_logprobs[0], outs[0].num_cached_tokens

    int8, chunked, floats = core(kv_cache_dtype="int8"), core(kv_cache_dtype="int8", max_num_batched_tokens=3), core()
    spec = int8.runner.describe()["kv_cache_spec"]
    assert spec["dtype"] == "int8" and spec["bytes_per_token_per_layer"] == latent + 8
    cache = int8.runner.kv_caches[0][0]
    assert isinstance(cache, QuantizedKVCache) and list(cache.data.shape) == [32, 4, 1, latent]
    for i, prompt in enumerate(PROMPTS):
        tokens, first, _ = generate(int8, prompt, f"a{i}")
        assert generate(chunked, prompt, f"c{i}")[0] == tokens, f"prompt {i}: chunked"
        again, _, cached = generate(int8, prompt + tokens[:5], f"h{i}")  # its prompt's full blocks are cached
        assert cached >= 4 and again[:7] == tokens[5:], f"prompt {i}: prefix hit"
        _, float_first, _ = generate(floats, prompt, f"f{i}")
        # int8 moves these peaky tiny models' log-probs by up to 0.085 here (the key/value int8
        # cache moves a tiny Llama's by up to 0.057): the same first token, log-probs within 0.15
        assert max(first, key=first.get) == max(float_first, key=float_first.get), f"prompt {i}"
        assert max(abs(first[t] - float_first[t]) for t in first.keys() & float_first.keys()) < 0.15, f"prompt {i}"
    assert np.abs(cache.data.numpy()).max() > 0


def test_a_bf16_kv_cache_is_refused_for_the_latent_cache(case):
    """``--kv-cache-dtype bfloat16`` covers key/value caches; the latent row is refused by name."""
    from fastdeploy_core.config import EngineArgs
    from fastdeploy_core.engine.engine_core import EngineCore

    _, path, _ = case
    with pytest.raises(ConfigError, match="kv_cache_dtype: bfloat16 is implemented for key/value caches; "
                       "DeepseekV3ForCausalLM caches one latent row") as info:
        EngineCore(EngineArgs.create(model=path, max_model_len=64, block_size=4, num_gpu_blocks_override=32,
                                     kv_cache_dtype="bf16"))
    assert info.value.param == "kv_cache_dtype"
