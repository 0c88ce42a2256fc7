"""Llama GGUF files (llama.cpp's ``llama`` architecture): tensor names, config, Q/K row order.

Registered with ``register_models(..., gguf=LLAMA_GGUF)`` (see :mod:`fd_llama`); the core's
GGUF loader calls these when it opens a file whose ``general.architecture`` is ``llama``.
Mistral-style checkpoints converted by llama.cpp carry this architecture too.
llama.cpp stores ``attn_q``/``attn_k`` rows permuted for its interleaved RoPE;
:func:`row_order` takes them back so the HF rotate_half convention of the layers applies.
"""

from __future__ import annotations

import numpy as np

from fastdeploy_core.errors import ModelLoadError

#: GGUF tensor name (without ``.weight``/``.bias``) -> HF name; ``None``: consumed through the
#: config (``rope_freqs`` becomes ``rope_scaling``) rather than loaded
TENSOR_NAMES: dict[str, str | None] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "rope_freqs": None,
    "blk.{bid}.attn_norm": "model.layers.{bid}.input_layernorm",
    "blk.{bid}.ffn_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.attn_q": "model.layers.{bid}.self_attn.q_proj",
    "blk.{bid}.attn_k": "model.layers.{bid}.self_attn.k_proj",
    "blk.{bid}.attn_v": "model.layers.{bid}.self_attn.v_proj",
    "blk.{bid}.attn_output": "model.layers.{bid}.self_attn.o_proj",
    "blk.{bid}.ffn_gate": "model.layers.{bid}.mlp.gate_proj",
    "blk.{bid}.ffn_up": "model.layers.{bid}.mlp.up_proj",
    "blk.{bid}.ffn_down": "model.layers.{bid}.mlp.down_proj",
}


def interleaved_rope_order(rows: int, num_heads: int) -> np.ndarray:
    """Row order undoing llama.cpp's interleaved-RoPE permutation of a Q or K projection.

    Within each head llama.cpp stores the rotary pairs side by side (rows 0,1 = pair 0);
    HF's rotate_half keeps the first halves of all pairs first. Row ``r`` of the HF tensor is
    row ``order[r]`` of the GGUF one.
    """
    head_dim = rows // num_heads
    return np.arange(rows).reshape(num_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)


def row_order(hf_name: str, rows: int, hf_config: dict) -> np.ndarray | None:
    """The interleaved-RoPE undo for ``q_proj``/``k_proj`` weights; other tensors keep their rows."""
    if hf_name.endswith("self_attn.q_proj.weight"):
        return interleaved_rope_order(rows, int(hf_config["num_attention_heads"]))
    if hf_name.endswith("self_attn.k_proj.weight"):
        heads = int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"])
        return interleaved_rope_order(rows, heads)
    return None


def _llama3_scaling_from_freqs(freq_factors: np.ndarray, head_dim: int, theta: float) -> dict | None:
    """Recover Llama-3 rope scaling parameters from llama.cpp's ``rope_freqs`` tensor."""
    from fastdeploy_core.layers.rotary import compute_inv_freq

    factor = float(np.max(freq_factors))
    base = compute_inv_freq(head_dim, theta, None)
    for original in (8192, 4096, 16384, 32768):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            scaling = {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
            implied = base / compute_inv_freq(head_dim, theta, scaling)
            if np.allclose(implied, freq_factors, rtol=1e-3, atol=1e-3):
                return scaling
    return None


def hf_config(gguf_file) -> dict:
    """The Llama ``config.json`` keys from a :class:`fastdeploy_core.loader.gguf_loader.GGUFFile`."""
    path, get = gguf_file.path, gguf_file.get
    try:
        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        config = {
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": int(get("feed_forward_length")),
            "num_hidden_layers": int(get("block_count")),
            "num_attention_heads": heads,
        }
    except (TypeError, ValueError):
        raise ModelLoadError(
            f"{path} lacks the llama.* hyper-parameters (embedding_length, block_count, ...)"
        ) from None
    tensor_names = gguf_file.tensor_names
    vocab = get("vocab_size")
    if vocab is None:
        vocab = gguf_file.token_count
    if vocab is None:
        vocab = gguf_file.tensor_shape("token_embd.weight")[0]
    head_dim = int(get("attention.key_length") or hidden // heads)
    config.update(
        num_key_value_heads=int(get("attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        vocab_size=int(vocab),
        tie_word_embeddings="output.weight" not in tensor_names,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )
    scaling_type = get("rope.scaling.type")
    if scaling_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"{path}: rope scaling type {scaling_type!r} is not supported (linear and llama3 are)")
    if "rope_freqs.weight" in tensor_names:
        factors = gguf_file.read_tensor("rope_freqs.weight").reshape(-1)
        scaling = _llama3_scaling_from_freqs(factors, head_dim, config["rope_theta"])
        if scaling is None:
            raise ModelLoadError(f"{path}: its rope_freqs tensor matches no known Llama-3 rope scaling")
        config["rope_scaling"] = scaling
    return config
