"""Tensor parallelism as the layers see it: this process's rank, the ranks' shares, the collectives.

A process that runs one rank of a tensor-parallel model calls :func:`set_tensor_parallel` before
the model is built; layers then ask :func:`tp_group` which part of each weight is theirs. With
one rank (the default) every share is the whole and the collectives are never called.

Shares are contiguous and as even as the unit allows (:func:`partition`): the first ranks take
one unit more when the count does not divide. So SmolLM2's 3 KV heads over 2 ranks are 2 + 1
(with their 6 + 3 query heads), which the row-parallel output projection and the sum of the
all-reduce handle like an even split. The collectives are the device's
(:meth:`Device.tp_collectives`; ``paddle.distributed`` on its ``dist_backend`` by default).
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle

from fastdeploy_core.devices.collectives import Collectives, PaddleCollectives
from fastdeploy_core.errors import ConfigError


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's ``rank`` among ``size`` ranks of one model, and the collectives they share
    (the device's, :meth:`Device.tp_collectives`)."""

    rank: int = 0
    size: int = 1
    collectives: Collectives | None = None

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        """The sum of ``x`` over the ranks (``x`` itself with one rank)."""
        return self.collectives.all_reduce(x) if self.size > 1 else x

    def all_gather_columns(self, x: paddle.Tensor, widths: list[int]) -> paddle.Tensor:
        """``[B, widths[rank]]`` on each rank -> ``[B, sum(widths)]`` in rank order on all."""
        return self.collectives.all_gather_columns(x, widths) if self.size > 1 else x


_GROUP = TensorParallelGroup()


def tp_group() -> TensorParallelGroup:
    """The group of the model being built or run in this process (one rank unless set)."""
    return _GROUP


def set_tensor_parallel(rank: int, size: int, collectives: Collectives | None = None) -> TensorParallelGroup:
    """Make this process rank ``rank`` of ``size``; ``collectives`` default to ``paddle.distributed``'s
    (its process group must be initialised already)."""
    global _GROUP
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in 0..{size - 1}")
    _GROUP = TensorParallelGroup(rank, size, collectives or PaddleCollectives())
    return _GROUP


def partition(total: int, size: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """Rank ``rank``'s contiguous ``[start, stop)`` of ``total`` split into ``size`` shares of
    whole ``unit``s (``total`` must be a multiple of ``unit``); the first ranks take the remainder."""
    units = total // unit
    base, extra = divmod(units, size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return start * unit, stop * unit


def split_unit(total: int, size: int) -> int:
    """The largest of 128, 64, ..., 1 dividing ``total`` that still gives every rank a share: a
    quantizer's groups (32 to 128 inputs) then never straddle two ranks."""
    for unit in (128, 64, 32, 16, 8, 4, 2, 1):
        if total % unit == 0 and total // unit >= size:
            return unit
    raise ConfigError(
        f"tensor_parallel_size: got {size}; a dimension of {total} cannot give each of {size} ranks a share; "
        "use fewer ranks",
        param="tensor_parallel_size",
    )


@dataclass(frozen=True)
class HeadShare:
    """The query heads ``[q_start, q_stop)`` and KV heads ``[kv_start, kv_stop)`` of one rank."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int

    @property
    def num_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start


def head_share(num_heads: int, num_kv_heads: int, group: TensorParallelGroup | None = None) -> HeadShare:
    """This rank's attention heads.

    With at least as many KV heads as ranks, KV heads are split (each with its query heads,
    unevenly when the count does not divide). With fewer, each KV head is replicated on
    ``size / num_kv_heads`` ranks and the query heads split evenly, which needs both divisions
    exact; otherwise a ConfigError names the numbers.
    """
    group = group or tp_group()
    size, rank = group.size, group.rank
    per_kv = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv_start, kv_stop = partition(num_kv_heads, size, rank)
        return HeadShare(kv_start * per_kv, kv_stop * per_kv, kv_start, kv_stop)
    if size % num_kv_heads or num_heads % size:
        raise ConfigError(
            f"tensor_parallel_size: got {size}; the model has {num_heads} attention heads and {num_kv_heads} KV heads: "
            f"with fewer KV heads than ranks, {size} must be a multiple of {num_kv_heads} and divide {num_heads}; "
            f"use a tensor parallel size of at most {num_kv_heads}",
            param="tensor_parallel_size",
        )
    q_start, q_stop = partition(num_heads, size, rank)
    kv = q_start // per_kv
    return HeadShare(q_start, q_stop, kv, kv + 1)


def take_rows(loaded, start: int, stop: int):
    """Rows ``[start, stop)`` of a checkpoint tensor in its ``[out, ...]`` orientation (a numpy
    array, or raw GGUF blocks, which slice themselves) without copying the rest."""
    if hasattr(loaded, "take_rows"):
        return loaded.take_rows(start, stop)
    return loaded[start:stop]


def take_columns(loaded, start: int, stop: int, full: int, where: str):
    """Inputs ``[start, stop)`` of ``full`` of a checkpoint tensor ``[out, in']``, where ``in'``
    is ``full`` itself or a fixed fraction of it (packed int4 halves it, group scales divide it
    by the group size). One-dimensional tensors (biases, per-row scales) are not split."""
    if hasattr(loaded, "take_columns"):
        return loaded.take_columns(start, stop)
    if getattr(loaded, "ndim", 1) < 2:
        return loaded
    width = int(loaded.shape[1])
    lo, hi = start * width, stop * width
    if lo % full or hi % full:
        raise ConfigError(
            f"tensor_parallel_size: {where}'s checkpoint tensor of shape {tuple(loaded.shape)} cannot be split at "
            f"inputs {start}:{stop} of {full} (its groups would straddle two ranks); use another tensor parallel size",
            param="tensor_parallel_size",
        )
    return loaded[:, lo // full:hi // full]
