"""The KV transport contract: how a prefill instance's KV blocks reach a decode instance's cache.

A device declares the transports it offers (``Device.kv_transports``, names) and builds them
(``Device.make_kv_transport(name)``). The prefill/decode channel (``fastdeploy_core/disaggregation``)
carries the control messages over its authenticated socket; a transport moves the bytes of one
batch of blocks:

* the sender (prefill) calls :meth:`KVTransport.send` with the blocks' bytes gathered from its
  cache by :meth:`KVTransport.gather`; it returns a description (JSON, signed with the message
  that carries it) and the frames (bytes) the message carries beside it, if any;
* the receiver (decode) calls :meth:`KVTransport.receive` with both, gets a byte view, hands it to
  :meth:`KVTransport.scatter` (which writes the blocks into its own cache) and then calls
  :meth:`KVTransport.release`.

``gather`` and ``scatter`` here work on caches a host numpy view can reach (the cpu device's;
integrated chips sharing host memory). A chip whose cache lives in its own memory overrides
them (and may declare transports that never touch the host, ``ipc`` / ``rdma``: none of those
is implemented in this repository, and no chip transport can be executed on this project's
machine).

The block bytes are laid out layer by layer, then cache tensor by cache tensor, each as
``tensor[block_ids]``; both sides check the same :func:`cache_signature` before any byte moves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np


def host_views(kv_caches: list[tuple]) -> list[tuple[np.ndarray, ...]]:
    """numpy views (no copy) of a cache's tensors, for caches in host memory; a ConfigError for a
    cache made of something else (an int8 KV cache's codes-and-scales objects).

    A bfloat16 cache (``--kv-cache-dtype bfloat16``; numpy has no bfloat16) is viewed as int16:
    the transports move its bytes unchanged, and its signature says int16, so it pairs only with
    another bfloat16 cache."""
    from fastdeploy_core.errors import ConfigError

    if any(not hasattr(t, "__dlpack__") for layer in kv_caches for t in layer):
        raise ConfigError("kv_cache_dtype: prefill/decode instances move float KV caches only; this one is "
                          "quantized (int8): drop --kv-cache-dtype int8 (or the checkpoint's KV quantization) on "
                          "prefill and decode instances", param="kv_cache_dtype")
    return [tuple(np.from_dlpack(_bits(t)) for t in layer) for layer in kv_caches]


def _bits(tensor):
    """``tensor``, or for a bfloat16 tensor the same memory as int16 (DLPack's bfloat16 has no numpy type)."""
    return tensor.view("int16") if str(getattr(tensor, "dtype", "")).endswith("bfloat16") else tensor


def cache_signature(views: list[tuple[np.ndarray, ...]]) -> list:
    """What must agree between the two sides: per layer, each tensor's per-block shape and dtype."""
    return [[[list(v.shape[1:]), str(v.dtype)] for v in layer] for layer in views]


def block_nbytes(views: list[tuple[np.ndarray, ...]]) -> int:
    """Bytes one block takes across every layer and tensor."""
    return sum(v[0].nbytes for layer in views for v in layer)


def _block_spans(views: list[tuple[np.ndarray, ...]], count: int) -> Iterator[tuple[np.ndarray, int, int]]:
    """Each cache tensor with the byte span ``[start, stop)`` its ``count`` blocks take in a batch
    (layer by layer, then tensor by tensor: the layout :meth:`KVTransport.gather` makes)."""
    offset = 0
    for layer in views:
        for v in layer:
            n = v[0].nbytes * count
            yield v, offset, offset + n
            offset += n


class KVTransport(ABC):
    """One way of moving KV block bytes between two instances (see the module docstring)."""

    #: ``--cache-transfer-protocol`` name.
    name: ClassVar[str] = ""
    #: Whether both instances must run on one host (then the decode side picks it only for a
    #: prefill instance it reaches on a local address).
    same_host_only: ClassVar[bool] = False

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0
        self.batches_sent = 0
        self.batches_received = 0

    # ---- sender ----------------------------------------------------------------------------
    @abstractmethod
    def buffer(self, nbytes: int, transfer_id: str) -> tuple[np.ndarray, dict[str, Any]]:
        """A writable uint8 buffer of ``nbytes`` for :meth:`gather` and what :meth:`send` needs to
        find it again."""

    @abstractmethod
    def send(self, buffer: np.ndarray, handle: dict[str, Any]) -> tuple[dict[str, Any], list]:
        """The description (JSON) and the frames that carry ``buffer`` to the receiver."""

    @staticmethod
    def gather(views: list[tuple[np.ndarray, ...]], block_ids: list[int], out: np.ndarray) -> None:
        """Copy ``block_ids`` of every layer and tensor into ``out`` (uint8, in the layout above)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        for v, start, stop in _block_spans(views, len(ids)):
            np.take(v, ids, axis=0, out=out[start:stop].view(v.dtype).reshape((len(ids), *v.shape[1:])))

    # ---- receiver --------------------------------------------------------------------------
    @abstractmethod
    def receive(self, description: dict[str, Any], frames: list) -> np.ndarray:
        """A uint8 view of the bytes sent (valid until :meth:`release`)."""

    def release(self, description: dict[str, Any]) -> None:
        """The receiver is done with the bytes of ``description``."""

    @staticmethod
    def scatter(views: list[tuple[np.ndarray, ...]], block_ids: list[int], data: np.ndarray) -> None:
        """Write ``data`` (the layout :meth:`gather` makes) into ``block_ids`` of the cache."""
        ids = np.asarray(block_ids, dtype=np.int64)
        stop = 0
        for v, start, stop in _block_spans(views, len(ids)):
            v[ids] = data[start:stop].view(v.dtype).reshape((len(ids), *v.shape[1:]))
        if stop != data.nbytes:
            raise ValueError(f"a KV batch of {data.nbytes} bytes does not hold {len(ids)} blocks ({stop} bytes)")

    def close(self) -> None:
        """Free what the transport holds (called when the engine stops)."""

    def stats(self) -> dict[str, int]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "batches_sent": self.batches_sent, "batches_received": self.batches_received}
