"""Qwen GGUF files (llama.cpp's ``qwen2``, ``qwen3``, ``qwen3moe``) registered by fd-qwen give the
same tokens as the safetensors checkpoint they were written from.

The test writes each tiny random transformers checkpoint again as a float32 GGUF file with the
``gguf`` package, naming tensors as llama.cpp's converter does: the names come from the installed
``gguf`` package (``gguf.constants.TENSOR_NAMES`` of each ``MODEL_TENSOR``), the metadata keys
from its ``GGUFWriter`` helpers, the experts of a ``qwen3moe`` layer stacked ``[E, out, in]``
per projection as llama.cpp stores them.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import gguf
import numpy as np
import pytest
import torch
import transformers
from fd_qwen.gguf import TENSOR_NAMES
from fd_qwen.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM
from gguf.constants import MODEL_ARCH, MODEL_TENSOR, MODEL_TENSORS
from safetensors.numpy import load_file

from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.loader import load_model_weights, resolve_model_source
from fastdeploy_core.testing.model_parity import check_paged, hf_reference

pytestmark = pytest.mark.usefixtures("restore_ops")

BASE = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "initializer_range": 0.25,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}

#: GGUF architecture -> (llama.cpp arch enum, transformers config / model class, our class, overrides)
CASES = {
    "qwen2": (MODEL_ARCH.QWEN2, "Qwen2Config", "Qwen2ForCausalLM", Qwen2ForCausalLM, {}),
    "qwen3": (MODEL_ARCH.QWEN3, "Qwen3Config", "Qwen3ForCausalLM", Qwen3ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3moe": (MODEL_ARCH.QWEN3MOE, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", Qwen3MoeForCausalLM, MOE),
}

#: llama.cpp's tensor (its enum) -> the HF name it holds
HF_OF = {
    MODEL_TENSOR.TOKEN_EMBD: "model.embed_tokens",
    MODEL_TENSOR.OUTPUT_NORM: "model.norm",
    MODEL_TENSOR.OUTPUT: "lm_head",
    MODEL_TENSOR.ATTN_NORM: "model.layers.{bid}.input_layernorm",
    MODEL_TENSOR.FFN_NORM: "model.layers.{bid}.post_attention_layernorm",
    MODEL_TENSOR.ATTN_Q: "model.layers.{bid}.self_attn.q_proj",
    MODEL_TENSOR.ATTN_K: "model.layers.{bid}.self_attn.k_proj",
    MODEL_TENSOR.ATTN_V: "model.layers.{bid}.self_attn.v_proj",
    MODEL_TENSOR.ATTN_OUT: "model.layers.{bid}.self_attn.o_proj",
    MODEL_TENSOR.ATTN_Q_NORM: "model.layers.{bid}.self_attn.q_norm",
    MODEL_TENSOR.ATTN_K_NORM: "model.layers.{bid}.self_attn.k_norm",
    MODEL_TENSOR.FFN_GATE: "model.layers.{bid}.mlp.gate_proj",
    MODEL_TENSOR.FFN_UP: "model.layers.{bid}.mlp.up_proj",
    MODEL_TENSOR.FFN_DOWN: "model.layers.{bid}.mlp.down_proj",
    MODEL_TENSOR.FFN_GATE_INP: "model.layers.{bid}.mlp.gate",
}
#: stacked expert tensors -> the per-expert HF projection
EXPERTS_OF = {
    MODEL_TENSOR.FFN_GATE_EXP: "gate_proj",
    MODEL_TENSOR.FFN_UP_EXP: "up_proj",
    MODEL_TENSOR.FFN_DOWN_EXP: "down_proj",
}

PROMPTS = [[1, 5, 17, 33, 8, 60, 42], [1, 90, 3]]
NEW_TOKENS = 24


def _write_gguf(hf_dir: str, path: str, arch_name: str, arch, cfg: dict) -> None:
    weights = {}
    for file in os.listdir(hf_dir):
        if file.endswith(".safetensors"):
            weights.update(load_file(os.path.join(hf_dir, file)))
    writer = gguf.GGUFWriter(path, arch_name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    if "num_experts" in cfg:
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    written = set()
    for tensor in MODEL_TENSORS[arch]:
        gguf_name = gguf.TENSOR_NAMES[tensor]
        for bid in range(cfg["num_hidden_layers"]) if "{bid}" in gguf_name else [None]:
            if tensor in EXPERTS_OF:
                per_expert = [
                    weights.get(f"model.layers.{bid}.mlp.experts.{e}.{EXPERTS_OF[tensor]}.weight")
                    for e in range(cfg.get("num_experts", 0))
                ]
                if per_expert and per_expert[0] is not None:
                    writer.add_tensor(gguf_name.format(bid=bid) + ".weight", np.stack(per_expert))
                    written.update(
                        f"model.layers.{bid}.mlp.experts.{e}.{EXPERTS_OF[tensor]}.weight"
                        for e in range(len(per_expert))
                    )
                continue
            if tensor not in HF_OF:
                continue
            for leaf in ("weight", "bias"):
                hf_name = f"{HF_OF[tensor].format(bid=bid)}.{leaf}"
                if hf_name in weights:
                    writer.add_tensor(f"{gguf_name.format(bid=bid)}.{leaf}", weights[hf_name])
                    written.add(hf_name)
    assert written == set(weights) - ({"lm_head.weight"} if cfg.get("tie_word_embeddings") else set())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _load(source, cls):
    model = cls(source.hf_config)
    model.eval()
    load_model_weights(model, source)
    return model


@pytest.mark.parametrize("arch_name", sorted(CASES))
def test_gguf_gives_the_safetensors_tokens(tmp_path, arch_name):
    set_current_ops(ReferenceOps())
    arch, config_cls, model_cls, ours, extra = CASES[arch_name]
    cfg = {**BASE, **extra}
    torch.manual_seed(99)
    hf_model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg)).eval()
    hf_dir = str(tmp_path / "hf")
    hf_model.save_pretrained(hf_dir, safe_serialization=True)
    gguf_path = str(tmp_path / f"{arch_name}.gguf")
    _write_gguf(hf_dir, gguf_path, arch_name, arch, {**hf_model.config.to_dict(), **cfg})

    source = resolve_model_source(gguf_path)
    assert source.format == "gguf" and source.hf_config["architectures"] == [model_cls]
    from_gguf, from_safetensors = _load(source, ours), _load(resolve_model_source(hf_dir), ours)
    reference = dict(from_safetensors.named_parameters())
    for name, param in from_gguf.named_parameters():
        np.testing.assert_array_equal(param.numpy(), reference[name].numpy(), err_msg=name)
    check_paged(from_gguf, PROMPTS, NEW_TOKENS, hf_reference(hf_model, PROMPTS, NEW_TOKENS))


def test_tensor_names_are_llama_cpps():
    """Every GGUF name fd-qwen maps is one llama.cpp writes for one of the three architectures."""
    written = {
        gguf.TENSOR_NAMES[t]
        for a in (MODEL_ARCH.QWEN2, MODEL_ARCH.QWEN3, MODEL_ARCH.QWEN3MOE)
        for t in MODEL_TENSORS[a]
    }
    assert set(TENSOR_NAMES) <= written
