"""Native Llama-family model (Llama 2/3/3.1, SmolLM, Mistral-style) built from core layers.

Covers GQA, tied or untied embeddings, rope scaling (linear, llama3) and an explicit
``head_dim``. Q/K/V and gate/up are fused into one matmul each; checkpoint tensors keep their
HF names and are routed to the fused parameters by :attr:`LlamaForCausalLM.packed_modules_mapping`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import paddle
from paddle import nn

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.executor.forward_meta import ForwardMeta
from fastdeploy_core.layers.activation import get_gated_activation
from fastdeploy_core.layers.attention import Attention
from fastdeploy_core.layers.embedding import LMHead, VocabEmbedding
from fastdeploy_core.layers.linear import Linear, LinearMethodBase, MergedColumnLinear, QKVLinear
from fastdeploy_core.layers.norm import RMSNorm
from fastdeploy_core.layers.rotary import get_rope, rope_settings

logger = logging.getLogger(__name__)


class _Dims:
    """The sizes a Llama config implies, with HF's defaults filled in."""

    def __init__(self, cfg: dict):
        try:
            self.hidden_size = int(cfg["hidden_size"])
            self.intermediate_size = int(cfg["intermediate_size"])
            self.num_layers = int(cfg["num_hidden_layers"])
            self.num_heads = int(cfg["num_attention_heads"])
            self.vocab_size = int(cfg["vocab_size"])
        except KeyError as exc:
            raise ModelLoadError(f"Llama config is missing {exc.args[0]!r}; is config.json complete?") from None
        self.num_kv_heads = int(cfg.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(cfg.get("head_dim") or self.hidden_size // self.num_heads)
        self.rms_norm_eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.max_positions = int(cfg.get("max_position_embeddings") or 2048)
        self.attention_bias = bool(cfg.get("attention_bias", False))
        self.mlp_bias = bool(cfg.get("mlp_bias", False))
        self.hidden_act = cfg.get("hidden_act", "silu")
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.rope_theta, self.rope_scaling = rope_settings(cfg)
        # Mistral v0.1 style: each token attends to the last `sliding_window` positions only.
        window = cfg.get("sliding_window")
        self.sliding_window = int(window) if window and cfg.get("use_sliding_window", True) is not False else None
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window must be a positive number of tokens, the config has {window!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )


class LlamaAttention(nn.Layer):
    """Fused QKV projection, RoPE, paged attention, output projection."""

    def __init__(self, dims: _Dims, quant_config=None, prefix: str = ""):
        super().__init__()
        self.num_heads = dims.num_heads
        self.num_kv_heads = dims.num_kv_heads
        self.head_dim = dims.head_dim
        self.qkv_proj = QKVLinear(
            dims.hidden_size,
            dims.head_dim,
            dims.num_heads,
            dims.num_kv_heads,
            bias=dims.attention_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = Linear(
            dims.num_heads * dims.head_dim,
            dims.hidden_size,
            bias=dims.attention_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(dims.head_dim, dims.max_positions, dims.rope_theta, dims.rope_scaling)
        self.attn = Attention(dims.num_heads, dims.head_dim, dims.num_kv_heads, sliding_window=dims.sliding_window)

    def forward(self, positions: paddle.Tensor, hidden: paddle.Tensor, kv_cache, meta: ForwardMeta) -> paddle.Tensor:
        qkv = self.qkv_proj(hidden)
        return self.o_proj(self.attn.forward_qkv(qkv, positions, self.rotary_emb, kv_cache, meta))


class LlamaMLP(nn.Layer):
    """SwiGLU MLP with gate and up fused into one matmul."""

    def __init__(self, dims: _Dims, quant_config=None, prefix: str = ""):
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(
            dims.hidden_size,
            [dims.intermediate_size, dims.intermediate_size],
            bias=dims.mlp_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = Linear(
            dims.intermediate_size,
            dims.hidden_size,
            bias=dims.mlp_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = get_gated_activation(dims.hidden_act)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Layer):
    """Pre-norm attention and MLP blocks with a residual stream carried between layers."""

    def __init__(self, dims: _Dims, quant_config=None, prefix: str = ""):
        super().__init__()
        self.self_attn = LlamaAttention(dims, quant_config, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(dims, quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Layer):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, dims: _Dims, quant_config=None, prefix: str = "model"):
        super().__init__()
        self.embed_tokens = VocabEmbedding(dims.vocab_size, dims.hidden_size, quant_config, prefix=f"{prefix}.embed_tokens")
        self.layers = nn.LayerList(
            [LlamaDecoderLayer(dims, quant_config, prefix=f"{prefix}.layers.{i}") for i in range(dims.num_layers)]
        )
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)

    def forward(self, meta: ForwardMeta, kv_caches) -> paddle.Tensor:
        hidden = self.embed_tokens(meta.input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(meta.positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Layer):
    """Llama causal LM over a paged KV cache.

    ``forward(meta, kv_caches) -> hidden [T, H]`` for the step's flattened tokens;
    ``compute_logits(hidden [B, H]) -> [B, V]`` float32; ``compute_greedy_tokens(hidden [B, H])
    -> int64 [B]`` (its argmax, possibly without all the logits); ``load_weights`` takes
    ``(hf_name, numpy array)`` pairs.
    """

    #: checkpoint projection name -> (fused parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    #: checkpoint tensors that carry nothing this implementation needs
    ignored_weight_suffixes = ("rotary_emb.inv_freq",)
    #: The forward is ops-table calls only (no Paddle op with a side effect of its own), so a
    #: decode step may be captured and replayed (see fastdeploy_core/executor/decode_graph.py).
    supports_graph_capture = True

    def __init__(self, hf_config: dict, quant_config=None):
        super().__init__()
        self.config = hf_config
        self.dims = _Dims(hf_config)
        self.quant_config = quant_config
        self.model = LlamaModel(self.dims, quant_config)
        self.lm_head = LMHead(self.dims.vocab_size, self.dims.hidden_size, quant_config=quant_config)

    def forward(self, meta: ForwardMeta, kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]]) -> paddle.Tensor:
        return self.model(meta, kv_caches)

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        return self.lm_head(hidden)

    def compute_greedy_tokens(self, hidden: paddle.Tensor) -> np.ndarray:
        """``argmax(compute_logits(hidden))`` per row (first index on ties) as int64 ``[B]``; the
        runner calls it when every sampled request of a step is plain greedy."""
        return self.lm_head.greedy_tokens(hidden)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the paged KV cache this model needs."""
        return self.dims.num_layers, self.dims.num_kv_heads, self.dims.head_dim

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> None:
        """Load HF-named checkpoint tensors; fused parameters are filled shard by shard.

        Raises :class:`ModelLoadError` for a tensor the model has no place for, a shape
        mismatch, or parameters the checkpoint did not provide.
        """
        params = dict(self.named_parameters())
        expected = {name: 1 for name in params}
        for name in params:
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                expected[name] = 3
            elif name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
                expected[name] = 2
        loaded: dict[str, set] = {}
        unexpected: list[str] = []
        tied = self.dims.tie_word_embeddings

        def put(param_name: str, array, shard=None) -> None:
            param = params[param_name]
            try:
                param.weight_loader(param, array, shard)
            except ModelLoadError as exc:
                if param_name.rsplit(".", 1)[0] in exc.message:
                    raise
                raise ModelLoadError(f"tensor for {param_name}: {exc.message}") from None
            loaded.setdefault(param_name, set()).add(shard)

        for name, array in weights:
            if name.endswith(self.ignored_weight_suffixes):
                continue
            if name == "lm_head.weight" and tied:
                continue  # a tied head is the embedding; HF ignores a stored copy as well
            for checkpoint_part, (fused_part, shard) in self.packed_modules_mapping.items():
                if f".{checkpoint_part}." in name:
                    fused = name.replace(f".{checkpoint_part}.", f".{fused_part}.")
                    if fused in params:
                        put(fused, array, shard)
                        break
            else:
                if name in params:
                    put(name, array)
                    if name == "model.embed_tokens.weight" and tied:
                        put("lm_head.weight", array)
                else:
                    unexpected.append(name)
        if unexpected:
            raise ModelLoadError(
                f"checkpoint has {len(unexpected)} tensors a Llama model has no place for, e.g. "
                f"{', '.join(unexpected[:5])}; is the checkpoint really {self.config.get('architectures', ['Llama'])[0]}?"
            )
        missing = [name for name, count in expected.items() if len(loaded.get(name, ())) < count]
        if missing:
            raise ModelLoadError(
                f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {', '.join(missing[:5])}"
            )
        for layer in self.sublayers():
            method = getattr(layer, "quant_method", None)
            if isinstance(method, LinearMethodBase):
                method.process_weights_after_loading(layer)
