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
from fastdeploy_core.layers.parallel import partition, take_rows, tp_group
from fastdeploy_core.layers.weights import copy_into, new_parameter


class VocabEmbedding(nn.Layer):
    """``ids [T] -> [T, H]`` lookup in a ``[vocab_size, hidden_size]`` table.

    A quantizer may store the table compactly: ``quant_config.get_embedding_method(layer,
    prefix)`` returns a method with ``create_weights(layer)`` and ``apply(layer, ids)``
    (``None`` keeps it float32).

    Under tensor parallelism each rank holds a contiguous share of the vocabulary's rows
    (``vocab_start``/``vocab_size`` are the share's); a token outside it looks up zeros and
    the ranks' rows are summed (all-reduce).
    """

    def __init__(self, vocab_size: int, hidden_size: int, quant_config=None, prefix: str = "model.embed_tokens"):
        super().__init__()
        group = tp_group()
        self.full_vocab_size = vocab_size
        self.vocab_start, stop = partition(vocab_size, group.size, group.rank)
        self.vocab_size = stop - self.vocab_start
        self.hidden_size = hidden_size
        self.prefix = prefix
        get_method = getattr(quant_config, "get_embedding_method", None)
        self.quant_method = get_method(self, prefix) if get_method is not None else None
        if self.quant_method is not None:
            self.quant_method.create_weights(self)
            return
        self.weight = new_parameter(self, [self.vocab_size, hidden_size])
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: paddle.Tensor, loaded, shard_id=None) -> None:
        copy_into(param, self.rank_rows(loaded), "embedding weight")

    def rank_rows(self, loaded):
        """This rank's rows of the checkpoint's ``[V, H]`` table (all of them on one rank)."""
        if self.vocab_size == self.full_vocab_size:
            return loaded
        return take_rows(loaded, self.vocab_start, self.vocab_start + self.vocab_size)

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        if self.vocab_size != self.full_vocab_size:
            return self._forward_share(ids)
        if self.quant_method is not None:
            return self.quant_method.apply(self, ids)
        return current_ops().embedding(ids, self.weight)

    def _forward_share(self, ids: paddle.Tensor) -> paddle.Tensor:
        local = ids - self.vocab_start
        inside = paddle.logical_and(local >= 0, local < self.vocab_size)
        local = paddle.where(inside, local, paddle.zeros_like(local))
        if self.quant_method is not None:
            rows = self.quant_method.apply(self, local)
        else:
            rows = current_ops().embedding(local, self.weight)
        rows = rows * inside.astype(rows.dtype).unsqueeze(-1)
        return tp_group().all_reduce(rows)


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

    Under tensor parallelism it is column-parallel over the vocabulary (each rank the same
    share of rows as the embedding) and the ranks' logits are gathered, so every rank holds all
    of them; greedy tokens are then the argmax of the gathered logits.
    """

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False, quant_config=None, prefix: str = "lm_head"):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        group = tp_group()
        self.vocab_widths = [b - a for a, b in (partition(vocab_size, group.size, r) for r in range(group.size))]
        super().__init__(
            hidden_size, vocab_size, bias=bias, quant_config=quant_config, prefix=prefix, tp="column",
            tp_range=partition(vocab_size, group.size, group.rank),
        )
        self.greedy_state = None  # ops.prepare_greedy_head's result, set after loading
        # The default float32 method: the same weights and apply, plus the greedy state after loading.
        if type(self.quant_method) is UnquantizedLinearMethod:
            self.quant_method = UnquantizedLMHeadMethod()

    def forward(self, hidden: paddle.Tensor) -> paddle.Tensor:
        logits = super().forward(hidden)
        if self.tp_mode is not None:
            logits = tp_group().all_gather_columns(logits, self.vocab_widths)
        return logits

    def greedy_tokens(self, hidden: paddle.Tensor) -> np.ndarray:
        """Each row's argmax of ``self(hidden)`` (first index on ties) as int64 ``[B]``.

        A float32 head asks the device's ``greedy_lm_head`` (which may skip most logits); a
        quantized one its method's ``apply_argmax`` (the logits and ``argmax_rows``, or one
        device op for both: a bfloat16 head on AMX tiles).
        """
        ops = current_ops()
        if self.tp_mode is not None:
            return ops.argmax_rows(self(hidden))
        if isinstance(self.quant_method, UnquantizedLinearMethod):
            return ops.greedy_lm_head(hidden, self.weight, self.bias, self.greedy_state)
        return self.quant_method.apply_argmax(self, hidden)
