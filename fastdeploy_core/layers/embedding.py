"""Token embedding and LM head, tied or untied.

The embedding keeps the checkpoint layout ``[V, H]``; the LM head keeps ``[H, V]`` because
Paddle's CPU matmul is about twice as fast without ``transpose_y`` on this shape. A tied
head therefore holds a transposed copy of the embedding, filled from the same checkpoint
tensor at load time.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from fastdeploy_core.devices.current import current_ops
from fastdeploy_core.layers.linear import Linear, UnquantizedLinearMethod
from fastdeploy_core.layers.weights import copy_into, new_parameter


class VocabEmbedding(nn.Layer):
    """``ids [T] -> [T, H]`` lookup in a ``[vocab_size, hidden_size]`` table.

    A quantizer may store the table compactly: ``quant_config.get_embedding_method(layer,
    prefix)`` returns a method with ``create_weights(layer)`` and ``apply(layer, ids)``
    (``None`` keeps it float32).
    """

    def __init__(self, vocab_size: int, hidden_size: int, quant_config=None, prefix: str = "model.embed_tokens"):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.prefix = prefix
        get_method = getattr(quant_config, "get_embedding_method", None)
        self.quant_method = get_method(self, prefix) if get_method is not None else None
        if self.quant_method is not None:
            self.quant_method.create_weights(self)
            return
        self.weight = new_parameter(self, [vocab_size, hidden_size])
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: paddle.Tensor, loaded, shard_id=None) -> None:
        copy_into(param, loaded, "embedding weight")

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, ids)
        return current_ops().embedding(ids, self.weight)


class UnquantizedLMHeadMethod(UnquantizedLinearMethod):
    """A float32 head: the device's linear layout plus its greedy-head state (``ops.prepare_greedy_head``)."""

    def process_weights_after_loading(self, layer: LMHead) -> None:
        super().process_weights_after_loading(layer)
        layer.greedy_state = current_ops().prepare_greedy_head(layer.weight) if layer.bias is None else None


class LMHead(Linear):
    """``hidden [B, H] -> logits [B, V]`` (float32), weight stored ``[H, V]``.

    Loaded from ``lm_head.weight`` (untied) or from the embedding tensor (tied); both arrive
    in the checkpoint's ``[V, H]`` layout. It is a :class:`Linear` named ``lm_head``, so a
    quantizer may give it a quantized method (weight-only methods store it as int8).
    :meth:`greedy_tokens` gives the greedy tokens without the logits where the device can.
    """

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False, quant_config=None, prefix: str = "lm_head"):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        super().__init__(hidden_size, vocab_size, bias=bias, quant_config=quant_config, prefix=prefix)
        self.greedy_state = None  # ops.prepare_greedy_head's result, set after loading
        # The default float32 method: the same weights and apply, plus the greedy state after loading.
        if type(self.quant_method) is UnquantizedLinearMethod:
            self.quant_method = UnquantizedLMHeadMethod()

    def greedy_tokens(self, hidden: paddle.Tensor) -> np.ndarray:
        """Each row's argmax of ``self(hidden)`` (first index on ties) as int64 ``[B]``.

        A float32 head asks the device's ``greedy_lm_head`` (which may skip most logits); a
        quantized one computes its logits and takes ``argmax_rows``.
        """
        ops = current_ops()
        if isinstance(self.quant_method, UnquantizedLinearMethod):
            return ops.greedy_lm_head(hidden, self.weight, self.bias, self.greedy_state)
        return ops.argmax_rows(self(hidden))
