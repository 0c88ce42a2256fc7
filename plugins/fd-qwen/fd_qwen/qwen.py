"""Native Qwen2, Qwen3 and Qwen3-MoE models on the core's generic decoder.

What sets them apart from Llama (read from transformers' ``modeling_qwen2``/``modeling_qwen3``):
Qwen2 always has a bias on the Q/K/V projections and none on the output projection; Qwen3 has a
bias on all four only when ``attention_bias`` is set, and normalises every query and key head
(RMSNorm over ``head_dim``, weights ``q_norm``/``k_norm``) before the rotary embedding. Both
slide a window over the layers from ``max_window_layers`` on when ``use_sliding_window`` is set
(or over the layers ``layer_types`` marks ``sliding_attention``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
from paddle import nn

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.layers.decoder import DecoderDims, DecoderForCausalLM
from fastdeploy_core.layers.moe import SparseMoeBlock


def qwen_sliding_layers(hf_config: dict, num_layers: int) -> list[int]:
    """The layers with a sliding window, as transformers' Qwen configs derive them."""
    if not hf_config.get("use_sliding_window") or not hf_config.get("sliding_window"):
        return []
    layer_types = hf_config.get("layer_types")
    if layer_types:
        if len(layer_types) != num_layers:
            raise ModelLoadError(
                f"layer_types lists {len(layer_types)} layers, num_hidden_layers is {num_layers}; fix config.json"
            )
        return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    first = int(hf_config.get("max_window_layers", 28))
    return list(range(first, num_layers))


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 causal LM over a paged KV cache (see :class:`DecoderForCausalLM` for the interface)."""

    family = "Qwen2"

    def make_dims(self, hf_config: dict) -> DecoderDims:
        dims = DecoderDims(hf_config, self.family)
        dims.qkv_bias, dims.o_bias = True, False
        dims.set_sliding_window(hf_config.get("sliding_window"), qwen_sliding_layers(hf_config, dims.num_layers))
        return dims


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 causal LM: per-head Q/K RMSNorm, optional bias on all attention projections."""

    family = "Qwen3"

    def make_dims(self, hf_config: dict) -> DecoderDims:
        dims = DecoderDims(hf_config, self.family)
        dims.qkv_bias = dims.o_bias = bool(hf_config.get("attention_bias", False))
        dims.qk_norm = True
        dims.set_sliding_window(hf_config.get("sliding_window"), qwen_sliding_layers(hf_config, dims.num_layers))
        return dims


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3 attention with routed experts (transformers' ``modeling_qwen3_moe``).

    Layer ``i`` is a mixture of ``num_experts`` experts of width ``moe_intermediate_size``
    (softmax router, ``num_experts_per_tok`` per token, renormalised when ``norm_topk_prob``)
    unless ``i`` is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; then it is a
    gated MLP of width ``intermediate_size``. No shared experts.
    """

    family = "Qwen3-MoE"
    #: a GGUF file's experts of one projection stacked ``[E, out, in]`` (see :mod:`fd_qwen.gguf`)
    _STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.weight$")
    #: fused_moe's reference groups tokens by expert with a host-side count: not capturable.
    supports_graph_capture = False

    def make_mlp(self, layer_index: int, prefix: str) -> nn.Layer:
        cfg = self.config
        # transformers 5 writes the count as num_local_experts; Qwen's own configs as num_experts.
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step = int(cfg.get("decoder_sparse_step") or 1)
        if step < 1:
            raise ModelLoadError(f"decoder_sparse_step must be at least 1, the config has {step}")
        sparse = layer_index not in (cfg.get("mlp_only_layers") or []) and num_experts > 0
        if not sparse or (layer_index + 1) % step:
            return super().make_mlp(layer_index, prefix)
        try:
            width = int(cfg["moe_intermediate_size"])
        except KeyError:
            raise ModelLoadError(
                "Qwen3-MoE config is missing 'moe_intermediate_size'; is config.json complete?"
            ) from None
        return SparseMoeBlock(
            self.dims.hidden_size,
            num_experts,
            int(cfg.get("num_experts_per_tok") or 0),
            width,
            scoring="softmax",
            renormalize=bool(cfg.get("norm_topk_prob", False)),
            quant_config=self.quant_config,
            prefix=prefix,
        )

    def checkpoint_tensors(self, name: str, array) -> Iterator[tuple[str, object]]:
        stacked = self._STACKED_EXPERTS.match(name)
        if stacked is None:
            yield name, array
            return
        array = np.asarray(array)
        if array.ndim != 3:
            raise ModelLoadError(f"{name}: stacked experts must be [experts, out, in], the tensor is {array.shape}")
        layer, part = stacked.groups()
        for expert in range(array.shape[0]):
            yield f"{layer}.{expert}.{part}.weight", array[expert]
