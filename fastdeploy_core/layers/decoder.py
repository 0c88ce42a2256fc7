"""A generic pre-norm decoder: what Llama, Mistral, Qwen2/3 and ERNIE-4.5 share.

Embedding, ``N`` x (RMSNorm -> attention -> RMSNorm -> feed-forward) with the residual stream
carried between layers, final RMSNorm, LM head. The families differ in small, declared ways:
which projections carry a bias, a per-head RMSNorm on Q and K (Qwen3), a sliding window on some
layers (Mistral, Qwen2), and what the feed-forward of a layer is (a gated MLP or a mixture of
experts). A model plugin states those in its :class:`DecoderDims` and, for the feed-forward,
in :meth:`DecoderForCausalLM.make_mlp`; checkpoint names it maps in
:meth:`DecoderForCausalLM.checkpoint_tensors`. Nothing here names a model family.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import paddle
from paddle import nn

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.layers.activation import SiluAndMul, get_gated_activation
from fastdeploy_core.layers.attention import Attention
from fastdeploy_core.layers.embedding import LMHead, VocabEmbedding
from fastdeploy_core.layers.kv_layout import KVCacheLayout
from fastdeploy_core.layers.linear import Linear, LinearMethodBase, MergedColumnLinear, QKVLinear
from fastdeploy_core.layers.moe import FusedMoE
from fastdeploy_core.layers.norm import RMSNorm
from fastdeploy_core.layers.parallel import head_share
from fastdeploy_core.layers.rotary import get_rope, rope_settings

if TYPE_CHECKING:
    from fastdeploy_core.executor.forward_meta import ForwardMeta


class DecoderDims:
    """The sizes and switches a decoder config implies, with HF's defaults filled in.

    ``family`` names the model family in error messages. Plugins adjust the switches after
    construction (``qkv_bias``, ``o_bias``, ``qk_norm``, ``layer_windows``) where their config
    spells them differently.
    """

    def __init__(self, cfg: dict, family: str = "decoder"):
        self.family = family
        try:
            self.hidden_size = int(cfg["hidden_size"])
            self.intermediate_size = int(cfg["intermediate_size"])
            self.num_layers = int(cfg["num_hidden_layers"])
            self.num_heads = int(cfg["num_attention_heads"])
            self.vocab_size = int(cfg["vocab_size"])
        except KeyError as exc:
            raise ModelLoadError(f"{family} config is missing {exc.args[0]!r}; is config.json complete?") from None
        self.num_kv_heads = int(cfg.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(cfg.get("head_dim") or self.hidden_size // self.num_heads)
        self.rms_norm_eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.max_positions = int(cfg.get("max_position_embeddings") or 2048)
        #: bias on the Q/K/V projections, and on the output projection
        self.qkv_bias = bool(cfg.get("attention_bias", False))
        self.o_bias = self.qkv_bias
        self.mlp_bias = bool(cfg.get("mlp_bias", False))
        #: RMSNorm over each head of Q and of K before the rotary embedding (Qwen3)
        self.qk_norm = False
        self.hidden_act = cfg.get("hidden_act", "silu")
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.rope_theta, self.rope_scaling = rope_settings(cfg)
        #: Per layer: attend to the last N positions only, or ``None`` for all of them.
        self.layer_windows: list[int | None] = [None] * self.num_layers
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )

    def set_sliding_window(self, window, layers: Iterable[int] | None = None) -> None:
        """Give ``layers`` (all when ``None``) a sliding window of ``window`` tokens (``None``/0: none)."""
        if not window:
            return
        if int(window) < 1:
            raise ModelLoadError(f"sliding_window must be a positive number of tokens, the config has {window!r}")
        for i in range(self.num_layers) if layers is None else layers:
            self.layer_windows[i] = int(window)


class DecoderAttention(nn.Layer):
    """Fused QKV projection, optional per-head Q/K RMSNorm, RoPE, paged attention, output projection."""

    def __init__(self, dims: DecoderDims, layer_index: int, quant_config=None, prefix: str = ""):
        super().__init__()
        # Under tensor parallelism: this rank's heads (column-parallel QKV), their share of the
        # output projection's inputs (row-parallel, all-reduced).
        self.qkv_proj = QKVLinear(
            dims.hidden_size,
            dims.head_dim,
            dims.num_heads,
            dims.num_kv_heads,
            bias=dims.qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
            tp="column",
        )
        heads = self.qkv_proj.heads
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = dims.head_dim
        self.o_proj = Linear(
            dims.num_heads * dims.head_dim,
            dims.hidden_size,
            bias=dims.o_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
            tp="row",
            tp_range=(heads.q_start * dims.head_dim, heads.q_stop * dims.head_dim),
        )
        if dims.qk_norm:
            self.q_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps)
            self.k_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = get_rope(dims.head_dim, dims.max_positions, dims.rope_theta, dims.rope_scaling)
        self.attn = Attention(
            self.num_heads, dims.head_dim, self.num_kv_heads, sliding_window=dims.layer_windows[layer_index]
        )

    @property
    def takes_bf16_rows(self) -> bool:
        """Whether ``hidden`` may come as bfloat16 rows: the QKV projection takes them."""
        return self.qkv_proj.takes_bf16_rows

    def forward(self, positions: paddle.Tensor, hidden: paddle.Tensor, kv_cache, meta: ForwardMeta) -> paddle.Tensor:
        qkv = self.qkv_proj(hidden)
        if self.q_norm is not None:
            qkv = self._norm_qk_heads(qkv)
        return self.o_proj(self.attn.forward_qkv(qkv, positions, self.rotary_emb, kv_cache, meta))

    def _norm_qk_heads(self, qkv: paddle.Tensor) -> paddle.Tensor:
        """RMSNorm of every query and key head over its ``head_dim``; values pass through."""
        tokens, d = qkv.shape[0], self.head_dim
        q, k, v = paddle.split(qkv, [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], axis=-1)
        q = self.q_norm(q.reshape([tokens * self.num_heads, d])).reshape([tokens, self.num_heads * d])
        k = self.k_norm(k.reshape([tokens * self.num_kv_heads, d])).reshape([tokens, self.num_kv_heads * d])
        return paddle.concat([q, k, v], axis=-1)


class GatedMLP(nn.Layer):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        bias: bool = False,
        quant_config=None,
        prefix: str = "",
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(
            hidden_size,
            [intermediate_size, intermediate_size],
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
            tp="column",
        )
        # this rank's share of the intermediate features: the same split as gate and up
        share = self.gate_up_proj.tp_rows[0] if self.gate_up_proj.tp_rows else None
        self.down_proj = Linear(
            intermediate_size, hidden_size, bias=bias, quant_config=quant_config, prefix=f"{prefix}.down_proj",
            tp="row", tp_range=share,
        )
        self.act_fn = get_gated_activation(hidden_act)

    @property
    def takes_bf16_rows(self) -> bool:
        """Whether ``x`` may come as bfloat16 rows: the gate/up projection takes them."""
        return self.gate_up_proj.takes_bf16_rows

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if isinstance(self.act_fn, SiluAndMul):  # the projection's method may fuse the two
            return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Layer):
    """Pre-norm attention and feed-forward blocks with a residual stream carried between layers."""

    def __init__(
        self,
        dims: DecoderDims,
        layer_index: int,
        mlp: nn.Layer,
        quant_config=None,
        prefix: str = "",
        attention: nn.Layer | None = None,
    ):
        super().__init__()
        # ``attention``: a family's own block, ``forward(positions, hidden, kv_cache, meta)``.
        self.self_attn = attention or DecoderAttention(dims, layer_index, quant_config, prefix=f"{prefix}.self_attn")
        self.mlp = mlp
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        # The normed rows go to the blocks as bfloat16 where their first layer takes them so
        # (bfloat16 linears: the same result, and the rounding done in the norm's own pass).
        attn_bf16 = getattr(self.self_attn, "takes_bf16_rows", False)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, bf16_rows=attn_bf16)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, bf16_rows=attn_bf16)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual,
                                                         bf16_rows=getattr(self.mlp, "takes_bf16_rows", False))
        return self.mlp(hidden), residual


class DecoderModel(nn.Layer):
    """Embedding, decoder layers and the final norm; ``make_mlp(index, prefix)`` builds each
    feed-forward, ``make_attention(index, prefix)`` (when given) each attention block."""

    def __init__(self, dims: DecoderDims, make_mlp, quant_config=None, prefix: str = "model", make_attention=None):
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            dims.vocab_size, dims.hidden_size, quant_config, prefix=f"{prefix}.embed_tokens"
        )
        layers = []
        for i in range(dims.num_layers):
            layer_prefix = f"{prefix}.layers.{i}"
            attention = make_attention(i, f"{layer_prefix}.self_attn") if make_attention is not None else None
            mlp = make_mlp(i, f"{layer_prefix}.mlp")
            layers.append(DecoderLayer(dims, i, mlp, quant_config, prefix=layer_prefix, attention=attention))
        self.layers = nn.LayerList(layers)
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)

    def forward(self, meta: ForwardMeta, kv_caches) -> paddle.Tensor:
        hidden = self.embed_tokens(meta.input_ids)
        residual = None
        after_layer = meta.after_layer
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden, residual = layer(meta.positions, hidden, residual, kv_cache, meta)
            if after_layer is not None:
                after_layer(index)
        hidden, _ = self.norm(hidden, residual)
        return hidden


#: ``<layer>.experts.<e>.<gate_proj|up_proj|down_proj>.weight``: one expert's tensor in the HF layout
_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class DecoderForCausalLM(nn.Layer):
    """A decoder causal LM over a paged KV cache; model plugins subclass it.

    ``forward(meta, kv_caches) -> hidden [T, H]`` for the step's flattened tokens;
    ``compute_logits(hidden [B, H]) -> [B, V]`` float32; ``compute_greedy_tokens(hidden [B, H])
    -> int64 [B]`` (its argmax, possibly without all the logits); ``load_weights`` takes
    ``(checkpoint name, numpy array)`` pairs.

    A subclass sets :attr:`family`, may override :meth:`make_dims` (its config's switches),
    :meth:`make_mlp` (the feed-forward of each layer) and :meth:`checkpoint_tensors` (names and
    layouts of its checkpoints that differ from the HF Llama ones).
    """

    family = "decoder"
    #: checkpoint projection name -> (fused parameter name, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
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
        self.dims = self.make_dims(hf_config)
        self.quant_config = quant_config
        self.model = DecoderModel(self.dims, self.make_mlp, quant_config, make_attention=self.make_attention)
        self.lm_head = LMHead(self.dims.vocab_size, self.dims.hidden_size, quant_config=quant_config)

    def make_dims(self, hf_config: dict) -> DecoderDims:
        return DecoderDims(hf_config, self.family)

    def make_mlp(self, layer_index: int, prefix: str) -> nn.Layer:
        """The feed-forward block of layer ``layer_index`` (a gated MLP here)."""
        dims = self.dims
        return GatedMLP(
            dims.hidden_size, dims.intermediate_size, dims.hidden_act, dims.mlp_bias, self.quant_config, prefix
        )

    def make_attention(self, layer_index: int, prefix: str) -> nn.Layer:
        """The attention block of layer ``layer_index`` (fused QKV over a key/value cache here); a
        family with another attention (latent, :mod:`fastdeploy_core.layers.mla`) returns its own
        and declares its cache in ``kv_cache_layout()``."""
        return DecoderAttention(self.dims, layer_index, self.quant_config, prefix=prefix)

    def forward(self, meta: ForwardMeta, kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]]) -> paddle.Tensor:
        return self.model(meta, kv_caches)

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        return self.lm_head(hidden)

    def compute_greedy_tokens(self, hidden: paddle.Tensor) -> np.ndarray:
        """``argmax(compute_logits(hidden))`` per row (first index on ties) as int64 ``[B]``; the
        runner calls it when every sampled request of a step is plain greedy."""
        return self.lm_head.greedy_tokens(hidden)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the paged KV cache this model needs (this
        rank's KV heads under tensor parallelism)."""
        return self.dims.num_layers, head_share(self.dims.num_heads, self.dims.num_kv_heads).num_kv_heads, self.dims.head_dim

    def kv_cache_layout(self) -> KVCacheLayout:
        """What the runner allocates per layer: a key and a value per KV head here."""
        return KVCacheLayout.key_value(*self.kv_cache_spec())

    def checkpoint_tensors(self, name: str, array) -> Iterator[tuple[str, object]]:
        """The HF-layout tensors one checkpoint tensor stands for (itself, here); a family whose
        checkpoints use other names or layouts renames, splits or reorders them here."""
        yield name, array

    def missing_tensors_error(self, missing: list[str]) -> ModelLoadError:
        """The error for parameters (by model name) the checkpoint did not fill; a family whose
        optional parts (e.g. MTP layers) a config switches on may say which switch asked for them."""
        return ModelLoadError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {', '.join(missing[:5])}")

    def _expected_shards(self, params: dict) -> dict[str, int]:
        """How many shards each parameter is loaded from (a fused projection: one per part)."""
        expected = {name: 1 for name in params}
        for prefix, layer in self.named_sublayers():
            if isinstance(layer, MergedColumnLinear):
                for leaf in ("weight", "bias"):
                    if f"{prefix}.{leaf}" in expected:
                        expected[f"{prefix}.{leaf}"] = len(layer.output_sizes)
            shards = getattr(layer, "checkpoint_shards", None)
            if shards is not None:
                for leaf, count in shards().items():
                    expected[f"{prefix}.{leaf}"] = count
        return expected

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> None:
        """Load checkpoint tensors; fused parameters are filled shard by shard.

        Raises :class:`ModelLoadError` for a tensor the model has no place for, a shape
        mismatch, or parameters the checkpoint did not provide.
        """
        params = dict(self.named_parameters())
        expected = self._expected_shards(params)
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

        def place(name: str, array) -> None:
            if name.endswith(self.ignored_weight_suffixes):
                return
            if name == "lm_head.weight" and tied:
                return  # a tied head is the embedding; HF ignores a stored copy as well
            expert = _EXPERT_TENSOR.match(name)
            if expert is not None:
                layer, index, part = expert.groups()
                target = f"{layer}.w2_weight" if part == "down_proj" else f"{layer}.w13_weight"
                if target in params:
                    put(target, array, (int(index), part))
                    return
            for checkpoint_part, (fused_part, shard) in self.packed_modules_mapping.items():
                if f".{checkpoint_part}." in name:
                    fused = name.replace(f".{checkpoint_part}.", f".{fused_part}.")
                    if fused in params:
                        put(fused, array, shard)
                        return
            if name in params:
                put(name, array)
                if name == "model.embed_tokens.weight" and tied:
                    put("lm_head.weight", array)
            else:
                unexpected.append(name)

        for name, array in weights:
            for hf_name, hf_array in self.checkpoint_tensors(name, array):
                place(hf_name, hf_array)
        if unexpected:
            architecture = self.config.get("architectures", [self.family])[0]
            raise ModelLoadError(
                f"checkpoint has {len(unexpected)} tensors a {self.family} model has no place for, e.g. "
                f"{', '.join(unexpected[:5])}; is the checkpoint really {architecture}?"
            )
        missing = [name for name, count in expected.items() if len(loaded.get(name, ())) < count]
        if missing:
            raise self.missing_tensors_error(missing)
        for layer in self.sublayers():
            method = getattr(layer, "quant_method", None)
            if isinstance(method, LinearMethodBase):
                method.process_weights_after_loading(layer)
            elif isinstance(layer, FusedMoE):
                layer.process_weights_after_loading()
