"""Native ERNIE-4.5 models (dense and mixture of experts) on the core's generic decoder.

Read from transformers' ``modeling_ernie4_5`` / ``modeling_ernie4_5_moe``: a Llama-shaped
decoder whose projections all carry a bias when ``use_bias`` is set, with tied embeddings by
default, and whose rotary embedding rotates *adjacent* pairs of a head (dims ``2i``, ``2i + 1``)
where the core's rotates halves (``i``, ``i + d/2``). Attention scores do not change when Q and K
reorder their head dims the same way, so the Q and K projection rows are reordered once at load
time (each head's even rows first, then its odd rows) and the core's attention applies as is.

The MoE model makes layer ``i`` a mixture of experts when ``(i + 1) % moe_layer_interval == 0``
and ``moe_layer_start_index <= i <= moe_layer_end_index`` (``-1``: the last layer): a softmax
router over ``moe_num_experts`` experts picks ``moe_k`` by score plus the router's correction
bias (``moe_statics.e_score_correction_bias``), weighs them by their unbiased scores
renormalised (floor ``moe_norm_min``), and adds ``moe_num_shared_experts`` shared experts (one
gated MLP ``moe_num_shared_experts`` times as wide).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from paddle import nn

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.layers.decoder import DecoderDims, DecoderForCausalLM, GatedMLP
from fastdeploy_core.layers.moe import SparseMoeBlock


def adjacent_to_half_rotation(rows: int, head_dim: int) -> np.ndarray:
    """Row order turning a projection for adjacent-pair RoPE into one for rotate-half RoPE:
    within each head, new row ``j < d/2`` is old row ``2j`` and new row ``d/2 + j`` old row ``2j + 1``."""
    return np.arange(rows).reshape(rows // head_dim, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)


class Ernie4_5ForCausalLM(DecoderForCausalLM):
    """ERNIE-4.5 dense causal LM (see :class:`DecoderForCausalLM` for the interface)."""

    family = "ERNIE-4.5"

    def make_dims(self, hf_config: dict) -> DecoderDims:
        dims = DecoderDims(hf_config, self.family)
        dims.qkv_bias = dims.o_bias = dims.mlp_bias = bool(hf_config.get("use_bias", False))
        dims.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", True))
        return dims

    def checkpoint_tensors(self, name: str, array) -> Iterator[tuple[str, object]]:
        if name.endswith(
            ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias")
        ):
            array = np.asarray(array)
            array = array[adjacent_to_half_rotation(array.shape[0], self.dims.head_dim)]
        yield name, array


class Ernie4_5_MoeForCausalLM(Ernie4_5ForCausalLM):
    """ERNIE-4.5 mixture-of-experts causal LM (the ``-PT`` checkpoints' HF layout)."""

    family = "ERNIE-4.5-MoE"
    #: fused_moe's reference groups tokens by expert with a host-side count: not capturable.
    supports_graph_capture = False

    def _moe_layers(self) -> range:
        cfg, last = self.config, self.dims.num_layers - 1
        start = int(cfg.get("moe_layer_start_index", 1))
        end = int(cfg.get("moe_layer_end_index", -1))
        end = last if end == -1 else end
        interval = int(cfg.get("moe_layer_interval", 1))
        if interval < 1:
            raise ModelLoadError(f"moe_layer_interval must be at least 1, the config has {interval}")
        return [i for i in range(max(start, 0), min(end, last) + 1) if (i + 1) % interval == 0]

    def make_mlp(self, layer_index: int, prefix: str) -> nn.Layer:
        cfg, dims = self.config, self.dims
        if layer_index not in self._moe_layers():
            return super().make_mlp(layer_index, prefix)
        num_experts = cfg.get("moe_num_experts", 64)
        if not isinstance(num_experts, int):
            raise ModelLoadError(
                f"moe_num_experts is {num_experts!r}; a text ERNIE-4.5-MoE has one expert count (a list is the "
                "vision-language model's, which this plugin does not serve)"
            )
        width = int(cfg.get("moe_intermediate_size", 1536))
        shared = int(cfg.get("moe_num_shared_experts", 2) or 0)
        shared_experts = (
            GatedMLP(
                dims.hidden_size,
                width * shared,
                dims.hidden_act,
                dims.mlp_bias,
                self.quant_config,
                f"{prefix}.shared_experts",
            )
            if shared > 0
            else None
        )
        return SparseMoeBlock(
            dims.hidden_size,
            num_experts,
            int(cfg.get("moe_k", 6)),
            width,
            scoring="softmax",
            renormalize=True,
            norm_min=float(cfg.get("moe_norm_min", 1e-12)),
            correction_bias=True,
            shared_experts=shared_experts,
            prefix=prefix,
        )

    def checkpoint_tensors(self, name: str, array) -> Iterator[tuple[str, object]]:
        # The router's correction bias lives in a statistics module of its own, shaped [1, E].
        if name.endswith(".mlp.moe_statics.e_score_correction_bias"):
            name = name.replace(".mlp.moe_statics.", ".mlp.")
        yield from super().checkpoint_tensors(name, array)
