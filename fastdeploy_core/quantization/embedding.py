"""int8 token embedding (``embedding_quant_type: "wint8"``): one scale per row (or per group of a row).

The table is ``weight int8 [V, H]`` with ``weight_scale [V, G]``; a lookup gathers the int8 rows
of the step's tokens and widens only those, so a step still reads a few rows while the table
takes a quarter of its float32 memory. A GGUF ``Q8_0`` embedding (SmolLM2's ``token_embd``) is
exactly int8 rows in groups of 32 and loads as stored.
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.quantization.codes import num_groups, quantize_int8


class Int8EmbeddingMethod:
    """How a :class:`~fastdeploy_core.layers.embedding.VocabEmbedding` stores and looks up int8 rows."""

    gguf_types = ("Q8_0",)

    def __init__(self, group_size: int | None = None):
        self.group_size = group_size

    def group_for(self, hidden: int) -> int:
        return self.group_size or hidden

    def create_weights(self, layer) -> None:
        vocab, hidden = layer.vocab_size, layer.hidden_size
        weight = layer.create_parameter(
            [vocab, hidden], dtype="int8", default_initializer=paddle.nn.initializer.Constant(0)
        )
        weight.stop_gradient = True
        weight.weight_loader = lambda param, loaded, shard_id=None: self.load(layer, loaded)
        layer.weight = weight
        layer.register_buffer(
            "weight_scale", paddle.zeros([vocab, num_groups(hidden, self.group_for(hidden))]), persistable=True
        )

    def accepts_gguf(self, type_name: str) -> bool:
        return type_name in self.gguf_types and self.group_size == 32

    def load(self, layer, loaded) -> None:
        """A float ``[V, H]`` table (quantized here) or Q8_0 :class:`GGUFBlocks` (taken as stored)."""
        from fastdeploy_core.loader.gguf_blocks import GGUFBlocks
        from fastdeploy_core.quantization.gguf import q8_0_to_int8

        shape = (layer.vocab_size, layer.hidden_size)
        loaded = layer.rank_rows(loaded)  # a tensor-parallel rank's share of the vocabulary
        if isinstance(loaded, GGUFBlocks):
            if loaded.shape != shape:
                raise ModelLoadError(f"embedding: GGUF tensor of shape {loaded.shape}, expected {shape}")
            if self.accepts_gguf(loaded.type_name):
                out = q8_0_to_int8(loaded)  # [H, V] orientation
            else:
                out = quantize_int8(loaded.dequantize().T, self.group_for(shape[1]))
        else:
            array = np.asarray(loaded, dtype=np.float32)
            if array.shape != shape:
                raise ModelLoadError(
                    f"embedding weight: checkpoint tensor has shape {array.shape}, the model expects {shape}"
                )
            out = quantize_int8(np.ascontiguousarray(array.T), self.group_for(shape[1]))
        layer.weight.set_value(paddle.to_tensor(np.ascontiguousarray(out["weight"].T)))
        layer.weight_scale.set_value(paddle.to_tensor(np.ascontiguousarray(out["weight_scale"].T)))

    def apply(self, layer, ids: paddle.Tensor) -> paddle.Tensor:
        """Rows of the table for ``ids [T]`` -> float32 ``[T, H]``."""
        from fastdeploy_core.devices.current import current_ops

        return current_ops().int8_embedding(ids, layer.weight, layer.weight_scale, self.group_for(layer.hidden_size))

    def dequantize(self, layer) -> paddle.Tensor:
        ids = paddle.arange(layer.vocab_size)
        return self.apply(layer, ids)
