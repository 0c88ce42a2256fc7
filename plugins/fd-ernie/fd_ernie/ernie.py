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

Both checkpoint layouts load. The Hugging Face one (``-PT`` repos) is transformers' names with
``[out, in]`` linear weights. The Paddle one (``-Paddle`` repos), read from PaddleFormers'
``ernie4_5``/``ernie4_5_moe`` modeling and its ``_get_tensor_parallel_mappings``, differs in:
the ``ernie.`` prefix where HF has ``model.``; ``[in, out]`` linear weights (``paddle.nn.Linear``);
``self_attn.qkv_proj`` holding Q, K and V side by side on the output axis (Q heads, then K
heads, then V heads); ``up_gate_proj`` holding the gate then the up projection on the output axis
(its MLP takes ``gate, up = chunk(2)``), in dense MLPs, experts and shared experts alike; and the
router ``mlp.gate`` as ``[hidden, experts]``; the embedding and the LM head (PaddleFormers'
``LMHead`` is a ``[vocab, hidden]`` weight) are stored as HF's are. Its rotary embedding rotates adjacent pairs as
transformers' does, so Q and K rows are in the same order in both layouts. The layout is told
from the tensor names: a checkpoint of Paddle's has every tensor under ``ernie.``.

Multi-token prediction (read from FastDeploy's ``ernie4_5_mtp`` and ``Ernie4_5_MTPModel``): a
checkpoint with ``num_nextn_predict_layers = n > 0`` carries ``n`` MTP layers under
``mtp_emb_norm.{k}``, ``mtp_hidden_norm.{k}``, ``mtp_linear_proj.{k}`` (the ``[embedding,
hidden]`` projection; ``[in, out]`` in the Paddle layout) and ``mtp_block.{k}`` (a decoder
layer built as layer ``k`` is: dense below ``moe_layer_start_index``), with the main model's
embedding, final norm (applied to the block's output) and LM head. They load into
:attr:`mtp_layers` (:mod:`fastdeploy_core.layers.mtp`) for the ``mtp`` speculative method; the
target's forward never runs them.
"""

from __future__ import annotations

from collections.abc import Iterator

import re

import numpy as np
from paddle import nn

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.layers.decoder import DecoderDims, DecoderForCausalLM, GatedMLP
from fastdeploy_core.layers.moe import SparseMoeBlock
from fastdeploy_core.layers.mtp import MultiTokenPrediction

#: ``ernie.`` is PaddleFormers' ``base_model_prefix`` for ERNIE-4.5; HF's is ``model.``
PADDLE_PREFIX = "ernie."
#: Paddle-layout linear weights stored ``[in, out]`` under the same name as HF's ``[out, in]``
_PADDLE_TRANSPOSED = ("self_attn.o_proj.weight", "down_proj.weight", "mlp.gate.weight")
#: the MTP layers' ``[embedding, hidden]`` projection, also ``[in, out]`` in the Paddle layout
_PADDLE_MTP_PROJECTION = re.compile(r"\.mtp_linear_proj\.\d+\.weight$")
#: ``model.mtp_<part>.<k>.<rest>``: an MTP layer's tensor (HF names, after the Paddle ones are mapped)
_MTP_TENSOR = re.compile(r"^model\.mtp_(block|emb_norm|hidden_norm|linear_proj)\.(\d+)\.(.+)$")
_MTP_PARTS = {"emb_norm": "enorm", "hidden_norm": "hnorm", "linear_proj": "eh_proj"}


def paddle_to_hf_tensors(name: str, array, dims: DecoderDims) -> Iterator[tuple[str, np.ndarray]]:
    """The HF-layout tensors one Paddle-layout ERNIE-4.5 tensor stands for (see the module doc)."""
    checkpoint_name = name
    name = "model." + name[len(PADDLE_PREFIX) :] if name.startswith(PADDLE_PREFIX) else name
    array = np.asarray(array)
    if name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
        q = dims.num_heads * dims.head_dim
        kv = dims.num_kv_heads * dims.head_dim
        if array.shape[-1] != q + 2 * kv:
            raise ModelLoadError(
                f"{checkpoint_name}: Paddle-layout fused QKV of shape {array.shape}, the config (num_attention_heads, "
                f"num_key_value_heads, head_dim) implies {q + 2 * kv} outputs; the checkpoint does not match "
                "its config.json"
            )
        leaf = name.rsplit(".", 1)[1]
        for part, rows in zip(("q_proj", "k_proj", "v_proj"), np.split(array, [q, q + kv], axis=-1)):
            yield name.replace("qkv_proj", part), rows.T.copy() if leaf == "weight" else rows
    elif name.endswith(("up_gate_proj.weight", "up_gate_proj.bias")):
        if array.shape[-1] % 2:
            raise ModelLoadError(
                f"{checkpoint_name}: a fused gate/up projection needs an even output width, it has {array.shape}"
            )
        gate, up = np.split(array, 2, axis=-1)
        transpose = name.endswith(".weight")
        yield name.replace("up_gate_proj", "gate_proj"), gate.T.copy() if transpose else gate
        yield name.replace("up_gate_proj", "up_proj"), up.T.copy() if transpose else up
    elif (name.endswith(_PADDLE_TRANSPOSED) or _PADDLE_MTP_PROJECTION.search(name)) and array.ndim == 2:
        yield name, array.T.copy()
    else:
        yield name, array


def adjacent_to_half_rotation(rows: int, head_dim: int) -> np.ndarray:
    """Row order turning a projection for adjacent-pair RoPE into one for rotate-half RoPE:
    within each head, new row ``j < d/2`` is old row ``2j`` and new row ``d/2 + j`` old row ``2j + 1``."""
    return np.arange(rows).reshape(rows // head_dim, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)


class Ernie4_5ForCausalLM(MultiTokenPrediction, DecoderForCausalLM):
    """ERNIE-4.5 dense causal LM (see :class:`DecoderForCausalLM` for the interface)."""

    family = "ERNIE-4.5"
    #: FastDeploy's ``Ernie4_5_MTPModel`` applies the main model's ``ernie.norm`` to the MTP block's output.
    mtp_own_output_norm = False

    def __init__(self, hf_config: dict, quant_config=None):
        super().__init__(hf_config, quant_config)
        self.build_mtp_layers(int(hf_config.get("num_nextn_predict_layers") or 0))

    def mtp_block_index(self, k: int) -> int:
        """``mtp_block.{k}`` is built as decoder layer ``k`` (FastDeploy reads the index off its name)."""
        return k

    def mtp_prefix(self, k: int) -> str:
        return f"model.mtp_block.{k}"

    def make_dims(self, hf_config: dict) -> DecoderDims:
        dims = DecoderDims(hf_config, self.family)
        dims.qkv_bias = dims.o_bias = dims.mlp_bias = bool(hf_config.get("use_bias", False))
        dims.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", True))
        return dims

    def checkpoint_tensors(self, name: str, array) -> Iterator[tuple[str, object]]:
        pairs = paddle_to_hf_tensors(name, array, self.dims) if name.startswith(PADDLE_PREFIX) else [(name, array)]
        for hf_name, hf_array in pairs:
            # The router's correction bias lives in a statistics module of its own, shaped [1, E].
            if hf_name.endswith(".mlp.moe_statics.e_score_correction_bias"):
                hf_name = hf_name.replace(".mlp.moe_statics.", ".mlp.")
            if hf_name.endswith(
                ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias")
            ):
                hf_array = np.asarray(hf_array)
                hf_array = hf_array[adjacent_to_half_rotation(hf_array.shape[0], self.dims.head_dim)]
            mtp = _MTP_TENSOR.match(hf_name)
            if mtp is not None:
                part, k, rest = mtp.groups()
                hf_name = f"mtp_layers.{k}.{rest}" if part == "block" else f"mtp_layers.{k}.{_MTP_PARTS[part]}.{rest}"
            yield hf_name, hf_array

    def missing_tensors_error(self, missing: list[str]) -> ModelLoadError:
        mtp = [name for name in missing if name.startswith("mtp_layers.")]
        if not mtp:
            return super().missing_tensors_error(missing)
        return ModelLoadError(
            f"config.json declares num_nextn_predict_layers={self.num_mtp_layers} multi-token-prediction layer(s) "
            f"(mtp_block, mtp_emb_norm, mtp_hidden_norm, mtp_linear_proj), but the checkpoint lacks {len(mtp)} of "
            f"their tensors, e.g. {', '.join(mtp[:5])} (our names); use the checkpoint with its MTP weights, or set "
            "num_nextn_predict_layers to 0 in config.json to serve without them"
        )


class Ernie4_5_MoeForCausalLM(Ernie4_5ForCausalLM):
    """ERNIE-4.5 mixture-of-experts causal LM (HF ``-PT`` or Paddle ``-Paddle`` checkpoints)."""

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
            quant_config=self.quant_config,
            prefix=prefix,
        )
