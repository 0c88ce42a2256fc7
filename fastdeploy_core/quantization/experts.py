"""Quantized MoE experts: a weight-only method's storage, stacked over the experts of a layer.

:class:`~fastdeploy_core.layers.moe.FusedMoE` asks its ``quant_config`` for
``get_moe_method(layer, prefix)``; a method that quantizes experts (``wint8``, ``wint4``)
answers with :class:`QuantizedExperts` wrapping itself. The storage is the method's own for one
``[in, out]`` linear (``storage_shapes``), with a leading expert axis: ``w13_weight`` /
``w13_weight_scale`` (/ ``w13_weight_offset``) for the gate and up projections side by side
(``[E, ..., 2I]``), ``w2_*`` for the down projection. Each checkpoint expert tensor is quantized
into its columns as it loads, exactly as a dense linear's shard is (``method.quantize``).

The computation is the ops table's ``fused_moe_<method>`` when a device has one, else the
reference: the experts the step's tokens chose are dequantized (``method.weight_from_storage``,
the formula of the method's linear op) and the float ``fused_moe`` op runs over them alone,
with the expert ids renumbered, so a step widens only the experts it uses.
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy_core.devices.current import current_ops
from fastdeploy_core.errors import ModelLoadError


class QuantizedExperts:
    """The experts of one :class:`~fastdeploy_core.layers.moe.FusedMoE` stored by ``method``."""

    def __init__(self, method):
        self.method = method

    def storage_names(self, projection: str) -> list[str]:
        """``w13_weight``, ``w13_weight_scale``... for ``projection`` ``w13`` or ``w2``."""
        return [f"{projection}_{name}" for name in self.method.storage_shapes(2, 2)]

    def create_weights(self, layer) -> None:
        """Register the stacked storage on ``layer``: the codes as parameters (the checkpoint
        fills them), the scales as buffers derived while the codes load."""
        current_ops().prepare_quantization()
        sizes = {
            "w13": (layer.hidden_size, 2 * layer.intermediate_size),
            "w2": (layer.intermediate_size, layer.hidden_size),
        }
        for projection, (rows, cols) in sizes.items():
            for name, (shape, dtype) in self.method.storage_shapes(rows, cols).items():
                full = [layer.num_experts, *shape]
                if name == "weight":
                    param = layer.create_parameter(
                        full, dtype=dtype, default_initializer=paddle.nn.initializer.Constant(0)
                    )
                    param.stop_gradient = True
                    param.weight_loader = layer.weight_loader
                    setattr(layer, f"{projection}_weight", param)
                else:
                    layer.register_buffer(f"{projection}_{name}", paddle.zeros(full, dtype=dtype), persistable=True)

    def load_expert(self, layer, projection: str, expert: int, start: int, array: np.ndarray) -> None:
        """Quantize float ``array [in, n]`` into columns ``[start, start + n)`` of ``expert``."""
        tensors = self.method.quantize(np.ascontiguousarray(array, dtype=np.float32))
        stop = start + array.shape[1]
        for name, codes in tensors.items():
            target = getattr(layer, f"{projection}_{name}")
            if tuple(codes.shape) != (int(target.shape[1]), stop - start):
                raise ModelLoadError(
                    f"{layer.prefix}.{expert}: {name} of shape {tuple(codes.shape)} does not fit the expert storage "
                    f"{tuple(target.shape[1:])}; check the quantization settings"
                )
            target[expert, :, start:stop] = paddle.to_tensor(np.ascontiguousarray(codes))

    def expert_weight(self, layer, projection: str, expert: int) -> paddle.Tensor:
        """Float32 ``[in, out]`` weight of ``expert``'s ``projection`` (the method's formula)."""
        tensors = {name[len(projection) + 1 :]: getattr(layer, name)[expert] for name in self.storage_names(projection)}
        rows = layer.hidden_size if projection == "w13" else layer.intermediate_size
        return self.method.weight_from_storage(tensors, rows)

    def apply(self, layer, x: paddle.Tensor, weights: paddle.Tensor, ids: paddle.Tensor) -> paddle.Tensor:
        ops = current_ops()
        op = getattr(ops, f"fused_moe_{self.method.name}", None)
        if op is not None:
            args = [getattr(layer, name) for name in self.storage_names("w13") + self.storage_names("w2")]
            return op(x, *args, weights, ids)
        used = np.unique(ids.numpy())
        renumber = np.zeros(layer.num_experts, dtype=np.int64)
        renumber[used] = np.arange(len(used))
        w13 = paddle.stack([self.expert_weight(layer, "w13", int(e)) for e in used])
        w2 = paddle.stack([self.expert_weight(layer, "w2", int(e)) for e in used])
        local_ids = paddle.index_select(paddle.to_tensor(renumber), ids.reshape([-1])).reshape(ids.shape)
        return ops.fused_moe(x, w13, w2, weights, local_ids)
