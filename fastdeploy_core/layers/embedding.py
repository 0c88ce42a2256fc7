"""Token embedding and LM head, tied or untied.

The embedding keeps the checkpoint layout ``[V, H]``; the LM head keeps ``[H, V]`` because
Paddle's CPU matmul is about twice as fast without ``transpose_y`` on this shape. A tied
head therefore holds a transposed copy of the embedding, filled from the same checkpoint
tensor at load time.
"""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy_core.devices.current import current_ops
from fastdeploy_core.layers.linear import Linear
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


class LMHead(Linear):
    """``hidden [B, H] -> logits [B, V]`` (float32), weight stored ``[H, V]``.

    Loaded from ``lm_head.weight`` (untied) or from the embedding tensor (tied); both arrive
    in the checkpoint's ``[V, H]`` layout. It is a :class:`Linear` named ``lm_head``, so a
    quantizer may give it a quantized method (weight-only methods store it as int8).
    """

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False, quant_config=None, prefix: str = "lm_head"):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        super().__init__(hidden_size, vocab_size, bias=bias, quant_config=quant_config, prefix=prefix)
