"""The collectives of tensor-parallel ranks: what a device offers, and Paddle's own.

``all_reduce(x)`` returns the sum of ``x`` over the ranks; ``all_gather_columns(x, widths)``
returns the ranks' ``[B, widths[rank]]`` blocks side by side. Every rank gets the same result.
:class:`PaddleCollectives` goes through ``paddle.distributed`` on the backend the device names
(``Device.dist_backend``); a device may offer faster ones (``Device.tp_collectives``: the cpu
device's shared-memory collectives for ranks on one host).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import paddle


class Collectives(ABC):
    """The contract (see the module docstring)."""

    #: shown in ``config-info`` (``collectives``)
    name = ""

    @abstractmethod
    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        """The sum of ``x`` over the ranks, on every rank."""

    @abstractmethod
    def all_gather_columns(self, x: paddle.Tensor, widths: list[int]) -> paddle.Tensor:
        """The ranks' ``[B, widths[rank]]`` blocks side by side, in rank order, on every rank."""


class PaddleCollectives(Collectives):
    """``paddle.distributed``'s all-reduce and all-gather (the process group must be initialised)."""

    name = "paddle.distributed"

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        paddle.distributed.all_reduce(x)
        return x

    def all_gather_columns(self, x: paddle.Tensor, widths: list[int]) -> paddle.Tensor:
        widest = max(widths)
        if x.shape[-1] < widest:  # the collective takes one shape: pad, then trim
            x = paddle.concat([x, paddle.zeros([x.shape[0], widest - x.shape[-1]], dtype=x.dtype)], axis=-1)
        parts: list[paddle.Tensor] = []
        paddle.distributed.all_gather(parts, x)
        return paddle.concat([part[:, :width] for part, width in zip(parts, widths)], axis=-1)
