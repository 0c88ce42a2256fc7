"""Activation layers."""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy_core.devices.current import current_ops


class SiluAndMul(nn.Layer):
    """SwiGLU on a merged gate/up projection: ``silu(x[..., :I]) * x[..., I:]``."""

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return current_ops().silu_and_mul(x)


_ACTIVATIONS = {"silu": SiluAndMul, "swish": SiluAndMul}


def get_gated_activation(name: str) -> nn.Layer:
    """The gated activation layer for a config's ``hidden_act`` (only SiLU gating so far)."""
    try:
        return _ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(f"hidden_act {name!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}") from None
