"""Native DeepSeek-V3 on the core's generic decoder (read from transformers' ``modeling_deepseek_v3``).

What sets it apart from Llama: multi-head latent attention (:mod:`fastdeploy_core.layers.mla`),
whose paged cache holds one latent row per token (``kv_lora_rank + qk_rope_head_dim``) instead
of per-head K and V; rotary pairs interleaved in the checkpoint when ``rope_interleave`` (reordered
once at load); YaRN rope scaling with its mscale on the softmax scale. The first
``first_k_dense_replace`` layers are gated MLPs; the others a mixture of ``n_routed_experts``
experts routed group-limited (sigmoid scores, ``e_score_correction_bias``, best ``topk_group``
of ``n_group`` groups, ``norm_topk_prob``, ``routed_scaling_factor``) plus ``n_shared_experts``
shared ones every token goes through.

Multi-token prediction: a checkpoint with ``num_nextn_predict_layers = n > 0`` carries ``n``
more layers after the last decoder layer (``model.layers.{N + k}``: ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm``, a full decoder block with a MoE feed-forward, and copies of
the embedding and LM head). They are loaded, checked and exposed as :attr:`mtp_layers`; the
target model's forward never runs them. The ``mtp`` speculative method drafts with them through
the model contract's MTP part: :attr:`num_mtp_layers`, :meth:`mtp_kv_cache_layout` (one latent
row per token and MTP layer, in the target's block ids) and :meth:`forward_mtp`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import paddle
from paddle import nn

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.layers.decoder import DecoderDims, DecoderForCausalLM, GatedMLP
from fastdeploy_core.layers.kv_layout import KVCacheLayout
from fastdeploy_core.layers.mla import MLADims, MultiHeadLatentAttention, deinterleave_rope_rows
from fastdeploy_core.layers.moe import FusedMoE, GroupedTopkRouter
from fastdeploy_core.layers.mtp import MultiTokenPrediction

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
#: Copies of the main model's embedding and LM head that DeepSeek checkpoints store per MTP
#: layer; the draft shares the main model's.
_MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


class DeepseekV3MoE(nn.Layer):
    """Group-limited routed experts plus shared experts: ``forward(x [T, H]) -> [T, H]``."""

    def __init__(self, cfg: dict, hidden_size: int, hidden_act: str, quant_config=None, prefix: str = ""):
        super().__init__()
        try:
            num_experts = int(cfg["n_routed_experts"])
            width = int(cfg["moe_intermediate_size"])
        except KeyError as exc:
            raise ModelLoadError(f"DeepSeek-V3 config is missing {exc.args[0]!r}; is config.json complete?") from None
        self.gate = GroupedTopkRouter(
            hidden_size,
            num_experts,
            int(cfg.get("num_experts_per_tok") or 0),
            int(cfg.get("n_group") or 1),
            int(cfg.get("topk_group") or 1),
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            correction_bias=True,
            scoring=str(cfg.get("scoring_func", "sigmoid")),
            prefix=f"{prefix}.gate",
        )
        self.experts = FusedMoE(num_experts, hidden_size, width, quant_config, prefix=f"{prefix}.experts")
        shared = int(cfg.get("n_shared_experts") or 0)
        self.shared_experts = (
            GatedMLP(hidden_size, width * shared, hidden_act, False, quant_config, f"{prefix}.shared_experts")
            if shared
            else None
        )

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekV3ForCausalLM(MultiTokenPrediction, DecoderForCausalLM):
    """DeepSeek-V3 causal LM over a paged latent cache (see :class:`DecoderForCausalLM` for the interface)."""

    family = "DeepSeek-V3"
    #: The reference fused_moe groups tokens by expert with a host-side count: not capturable.
    supports_graph_capture = False

    def __init__(self, hf_config: dict, quant_config=None):
        super().__init__(hf_config, quant_config)
        # Their order of the projection's input follows transformers' ``MtpLayer``: the embedding
        # first, unless the config sets ``mtp_hidden_states_first``.
        self.build_mtp_layers(
            int(hf_config.get("num_nextn_predict_layers") or 0), bool(hf_config.get("mtp_hidden_states_first", False))
        )

    def make_dims(self, hf_config: dict) -> DecoderDims:
        #: the latent-attention sizes, read first: the layers are built from them
        self.mla = MLADims(hf_config, self.family)
        dims = DecoderDims(hf_config, self.family)
        dims.qkv_bias = dims.o_bias = bool(hf_config.get("attention_bias", False))
        return dims

    def make_attention(self, layer_index: int, prefix: str) -> nn.Layer:
        return MultiHeadLatentAttention(self.mla, self.quant_config, prefix)

    def make_mlp(self, layer_index: int, prefix: str) -> nn.Layer:
        cfg = self.config
        if layer_index < int(cfg.get("first_k_dense_replace") or 0) or not cfg.get("n_routed_experts"):
            return super().make_mlp(layer_index, prefix)
        return DeepseekV3MoE(cfg, self.dims.hidden_size, self.dims.hidden_act, self.quant_config, prefix)

    def kv_cache_layout(self) -> KVCacheLayout:
        """One latent row per token and layer: ``kv_lora_rank + qk_rope_head_dim`` numbers."""
        return KVCacheLayout.latent(self.dims.num_layers, self.mla.kv_lora_rank, self.mla.qk_rope_head_dim)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """The layout as ``(num_layers, heads, width)`` of its one cache tensor per layer (one "head")."""
        return self.dims.num_layers, 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim

    def checkpoint_tensors(self, name: str, array) -> Iterator[tuple[str, object]]:
        """MTP layers' tensors renamed to :attr:`mtp_layers`; interleaved rotary rows reordered."""
        match = _LAYER.match(name)
        if match is not None and int(match.group(1)) >= self.dims.num_layers:
            k, rest = int(match.group(1)) - self.dims.num_layers, match.group(2)
            if k < self.num_mtp_layers:
                if rest in _MTP_SHARED_COPIES:
                    self._check_shared_copy(name, rest, array)
                    return
                name = f"mtp_layers.{k}.{rest}"
        if self.mla.rope_interleave:
            array = self._deinterleave(name, array)
        yield name, array

    def _check_shared_copy(self, name: str, rest: str, array) -> None:
        expected = (self.dims.vocab_size, self.dims.hidden_size)
        if tuple(np.shape(array)) != expected:
            raise ModelLoadError(
                f"{name}: checkpoint tensor of shape {tuple(np.shape(array))}, the config (vocab_size, hidden_size) "
                f"implies {expected}; the checkpoint does not match its config.json"
            )

    def _deinterleave(self, name: str, array):
        mla = self.mla
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            return deinterleave_rope_rows(array, mla.qk_rope_head_dim, mla.qk_head_dim)
        if ".self_attn.kv_a_proj_with_mqa." in name:
            return deinterleave_rope_rows(array, mla.qk_rope_head_dim, mla.kv_lora_rank + mla.qk_rope_head_dim)
        return array

    def missing_tensors_error(self, missing: list[str]) -> ModelLoadError:
        mtp = [name for name in missing if name.startswith("mtp_layers.")]
        if not mtp:
            return super().missing_tensors_error(missing)
        first = self.dims.num_layers

        def checkpoint_name(name: str) -> str:
            _, k, rest = name.split(".", 2)
            return f"model.layers.{first + int(k)}.{rest}"

        return ModelLoadError(
            f"config.json declares num_nextn_predict_layers={self.num_mtp_layers} multi-token-prediction layer(s) "
            f"(model.layers.{first}...), but the checkpoint lacks {len(mtp)} of their tensors, e.g. "
            f"{', '.join(checkpoint_name(n) for n in mtp[:5])}; use the checkpoint with its MTP weights, or set "
            "num_nextn_predict_layers to 0 in config.json to serve without them"
        )
