"""RMSNorm, with the fused residual-add form used between decoder layers."""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy_core.devices.current import current_ops
from fastdeploy_core.layers.weights import copy_into


class RMSNorm(nn.Layer):
    """Root-mean-square norm over the last axis with a learned scale (Llama style).

    ``forward(x)`` returns the normed tensor; ``forward(x, residual)`` adds the residual first
    and returns ``(normed, x + residual)`` so the next layer carries the new residual stream.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight = self.create_parameter(
            [hidden_size], dtype="float32", default_initializer=nn.initializer.Constant(1.0)
        )
        self.weight.stop_gradient = True
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: paddle.Tensor, loaded, shard_id=None) -> None:
        """Copy a checkpoint vector of shape ``[hidden_size]`` into ``param``."""
        copy_into(param, loaded, "RMSNorm weight")

    def forward(self, x: paddle.Tensor, residual: paddle.Tensor | None = None, bf16_rows: bool = False):
        """``bf16_rows``: the caller's next layer takes bfloat16 rows (a bfloat16 linear): where
        the ops table has ``rms_norm_bf16_rows`` the normed rows come rounded to bfloat16 (the
        same values that layer would round them to), else float32."""
        ops = current_ops()
        to_bf16 = getattr(ops, "rms_norm_bf16_rows", None) if bf16_rows else None
        if to_bf16 is not None:
            normed, summed = to_bf16(x, residual, self.weight, self.eps)
            return normed if residual is None else (normed, summed)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)
