"""Multi-token-prediction (MTP) layers, the draft of the ``mtp`` speculative method.

An MTP layer reads a pair: the embedding of the token at ``p + 1`` and a hidden state at ``p``
(the target's, or the layer's own output when chaining guesses). It normalises each
(``enorm``, ``hnorm``), projects their concatenation back to the hidden size (``eh_proj``, the
embedding first unless ``hidden_first``), runs one decoder block over a cache of its own, and
normalises the result; the main model's LM head over that output guesses the token at ``p + 2``.

Families differ in two things only, both chosen by the model class:

- the output norm: a layer's own (``shared_head.norm``: DeepSeek-V3, transformers' ``MtpLayer``
  with its post norm) or the main model's final norm (ERNIE-4.5, as FastDeploy's
  ``ernie4_5_mtp`` applies ``ernie.norm`` to the block's output);
- the index the block is built with (:meth:`MultiTokenPrediction.mtp_block_index`), which picks
  its feed-forward (dense or mixture of experts) and attention: DeepSeek numbers MTP layers after
  the decoder layers (``model.layers.{N + k}``), ERNIE by their own position (``mtp_block.{k}``).

:class:`MultiTokenPrediction` gives a :class:`~fastdeploy_core.layers.decoder.DecoderForCausalLM`
subclass the model contract's MTP part (``num_mtp_layers``, ``mtp_kv_cache_layout()``,
``forward_mtp()``; ``docs/writing-a-plugin.md``).
"""

from __future__ import annotations

import dataclasses

import paddle
from paddle import nn

from fastdeploy_core.layers.decoder import DecoderDims, DecoderLayer
from fastdeploy_core.layers.kv_layout import KVCacheLayout
from fastdeploy_core.layers.linear import Linear
from fastdeploy_core.layers.norm import RMSNorm


class MultiTokenPredictionLayer(DecoderLayer):
    """One MTP layer (see the module docstring); ``own_output_norm``: it carries
    ``shared_head.norm``, else :meth:`predict` is given the main model's final norm."""

    def __init__(
        self,
        dims: DecoderDims,
        layer_index: int,
        mlp: nn.Layer,
        quant_config,
        prefix: str,
        attention: nn.Layer | None = None,
        own_output_norm: bool = True,
        hidden_first: bool = False,
    ):
        super().__init__(dims, layer_index, mlp, quant_config, prefix=prefix, attention=attention)
        self.enorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.hnorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.eh_proj = Linear(2 * dims.hidden_size, dims.hidden_size, False, quant_config, f"{prefix}.eh_proj")
        if own_output_norm:
            self.shared_head = nn.Layer()
            self.shared_head.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        else:
            self.shared_head = None
        self.hidden_first = hidden_first

    def predict(self, meta, embeds: paddle.Tensor, previous_hidden: paddle.Tensor, kv_cache, final_norm=None):
        """The layer's output hidden state ``[T, H]`` (normalised) for the rows of ``meta``: row
        ``t`` pairs the embedding of a token with the hidden state of the position before it.
        ``final_norm``: the main model's norm, used when the layer has no norm of its own."""
        parts = [self.enorm(embeds), self.hnorm(previous_hidden)]
        if self.hidden_first:
            parts.reverse()
        hidden, residual = super().forward(meta.positions, self.eh_proj(paddle.concat(parts, axis=-1)), None, kv_cache, meta)
        norm = self.shared_head.norm if self.shared_head is not None else final_norm
        hidden, _ = norm(hidden, residual)
        return hidden


class MultiTokenPrediction:
    """The MTP part of the model contract for a ``DecoderForCausalLM`` subclass: call
    :meth:`build_mtp_layers` at the end of ``__init__``; the layers are loaded with the model
    (their checkpoint tensors renamed to ``mtp_layers.{k}.*`` by the family's
    ``checkpoint_tensors``) and never run by ``forward``."""

    #: The layer carries its own output norm (``shared_head.norm``); else the main model's final norm.
    mtp_own_output_norm = True
    num_mtp_layers = 0

    def build_mtp_layers(self, count: int, hidden_first: bool = False) -> None:
        self.num_mtp_layers = int(count)
        layers = []
        for k in range(self.num_mtp_layers):
            index = self.mtp_block_index(k)
            prefix = self.mtp_prefix(k)
            layers.append(
                MultiTokenPredictionLayer(
                    self.dims,
                    index,
                    self.make_mlp(index, f"{prefix}.mlp"),
                    self.quant_config,
                    prefix,
                    self.make_attention(index, f"{prefix}.self_attn"),
                    own_output_norm=self.mtp_own_output_norm,
                    hidden_first=hidden_first,
                )
            )
        #: The MTP layers (loaded and checked; the ``mtp`` proposer's draft, never run by forward).
        self.mtp_layers = nn.LayerList(layers)

    def mtp_block_index(self, k: int) -> int:
        """The layer index MTP layer ``k``'s block is built with (its feed-forward and attention):
        after the decoder layers here, as DeepSeek numbers them."""
        return self.dims.num_layers + k

    def mtp_prefix(self, k: int) -> str:
        """MTP layer ``k``'s name in the checkpoint (what quantization settings match)."""
        return f"model.layers.{self.dims.num_layers + k}"

    def mtp_kv_cache_layout(self) -> KVCacheLayout:
        """The MTP layers' cache: a decoder layer's rows per token and MTP layer."""
        return dataclasses.replace(self.kv_cache_layout(), num_layers=self.num_mtp_layers)

    def forward_mtp(self, meta, previous_hidden: paddle.Tensor, kv_caches, index: int = 0) -> paddle.Tensor:
        """MTP layer ``index`` over the rows of ``meta`` -> its hidden state ``[T, H]``
        (``compute_logits`` gives the draft's logits; the hidden state chains into the next
        guess). ``meta.input_ids[t]`` is the token at position ``p + 1`` and ``previous_hidden[t]``
        the hidden state the target (or this layer, chaining) gave at position ``p``;
        ``meta.positions`` are the tokens' own (``p + 1``, as in transformers' ``MtpLayer``; rotary
        attention depends on differences of positions only), while its slots, sequence lengths
        and block tables address the MTP cache ``kv_caches[index]`` (of
        :meth:`mtp_kv_cache_layout`) by row ``p``, so a sequence's rows start at 0."""
        embeds = self.model.embed_tokens(meta.input_ids)
        final_norm = None if self.mtp_own_output_norm else self.model.norm
        return self.mtp_layers[index].predict(meta, embeds, previous_hidden, kv_caches[index], final_norm)
