"""The ops table: override what the chip does its own way, inherit the rest from ReferenceOps."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from fastdeploy_core.devices.reference_ops import ReferenceOps


class ExampleOps(ReferenceOps):
    """RMSNorm and SwiGLU written out by hand; every other op is the reference one."""

    attention_backends = ("paged_reference",)

    def rms_norm(self, x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
        return x * paddle.rsqrt(paddle.mean(paddle.square(x), axis=-1, keepdim=True) + eps) * weight

    def add_rms_norm(self, x, residual, weight, eps):
        summed = x if residual is None else x + residual
        return self.rms_norm(summed, weight, eps), summed

    def silu_and_mul(self, x: paddle.Tensor) -> paddle.Tensor:
        gate, up = paddle.split(x, 2, axis=-1)
        return gate * F.sigmoid(gate) * up


class BrokenExampleOps(ExampleOps):
    """A deliberately wrong RMSNorm (divides by the mean square, not its root): the kit must catch it."""

    def rms_norm(self, x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
        return x / (paddle.mean(paddle.square(x), axis=-1, keepdim=True) + eps) * weight
