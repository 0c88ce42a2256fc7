"""Qwen GGUF files: llama.cpp's ``qwen2``, ``qwen3`` and ``qwen3moe`` architectures.

Registered with ``register_models(..., gguf=...)`` (see :mod:`fd_qwen`); the core's GGUF loader
calls these when it opens a file of one of these architectures. Tensor names are llama.cpp's
(``gguf.constants.TENSOR_NAMES`` for each architecture's ``MODEL_TENSORS``). llama.cpp runs
these models with its NeoX (rotate-half) rotary embedding, the layers' own convention, so its
converter leaves the Q/K rows as HF has them and no row order is needed. A ``qwen3moe`` file
stores each layer's experts stacked (``ffn_gate_exps`` ``[E, I, H]``...); they arrive as one
tensor per projection and :class:`~fd_qwen.qwen.Qwen3MoeForCausalLM` splits them per expert.
"""

from __future__ import annotations

from fastdeploy_core.errors import ModelLoadError

#: GGUF tensor name (without ``.weight``/``.bias``) -> HF name; the union of the three
#: architectures' tensors (a name absent from a file is simply never asked for)
TENSOR_NAMES: dict[str, str | None] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{bid}.attn_norm": "model.layers.{bid}.input_layernorm",
    "blk.{bid}.ffn_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.attn_q": "model.layers.{bid}.self_attn.q_proj",
    "blk.{bid}.attn_k": "model.layers.{bid}.self_attn.k_proj",
    "blk.{bid}.attn_v": "model.layers.{bid}.self_attn.v_proj",
    "blk.{bid}.attn_output": "model.layers.{bid}.self_attn.o_proj",
    "blk.{bid}.attn_q_norm": "model.layers.{bid}.self_attn.q_norm",
    "blk.{bid}.attn_k_norm": "model.layers.{bid}.self_attn.k_norm",
    "blk.{bid}.ffn_gate": "model.layers.{bid}.mlp.gate_proj",
    "blk.{bid}.ffn_up": "model.layers.{bid}.mlp.up_proj",
    "blk.{bid}.ffn_down": "model.layers.{bid}.mlp.down_proj",
    "blk.{bid}.ffn_gate_inp": "model.layers.{bid}.mlp.gate",
    "blk.{bid}.ffn_gate_exps": "model.layers.{bid}.mlp.experts.gate_proj",
    "blk.{bid}.ffn_up_exps": "model.layers.{bid}.mlp.experts.up_proj",
    "blk.{bid}.ffn_down_exps": "model.layers.{bid}.mlp.experts.down_proj",
}

_MODEL_TYPES = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}


def hf_config(gguf_file) -> dict:
    """The Qwen ``config.json`` keys from a :class:`fastdeploy_core.loader.gguf_loader.GGUFFile`."""
    path, get, arch = gguf_file.path, gguf_file.get, gguf_file.architecture
    try:
        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        layers = int(get("block_count"))
    except (TypeError, ValueError):
        raise ModelLoadError(
            f"{path} lacks the {arch}.* hyper-parameters (embedding_length, block_count, attention.head_count)"
        ) from None
    names = gguf_file.tensor_names
    vocab = gguf_file.token_count or gguf_file.tensor_shape("token_embd.weight")[0]
    config = {
        "model_type": _MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": int(get("attention.key_length") or hidden // heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 1000000.0)),
        "max_position_embeddings": int(get("context_length", 32768)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    if get("rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(f"{path}: rope scaling {get('rope.scaling.type')!r} is not supported for {arch} files")
    if arch == "qwen3moe":
        try:
            config.update(
                num_experts=int(get("expert_count")),
                num_experts_per_tok=int(get("expert_used_count")),
                moe_intermediate_size=int(get("expert_feed_forward_length")),
            )
        except (TypeError, ValueError):
            raise ModelLoadError(
                f"{path} lacks the qwen3moe expert hyper-parameters (expert_count, expert_used_count, "
                "expert_feed_forward_length)"
            ) from None
        # llama.cpp's qwen3moe graph always renormalises the chosen experts' weights.
        config["norm_topk_prob"] = True
        config["intermediate_size"] = int(get("feed_forward_length") or config["moe_intermediate_size"])
    else:
        config["intermediate_size"] = int(get("feed_forward_length"))
    return config
