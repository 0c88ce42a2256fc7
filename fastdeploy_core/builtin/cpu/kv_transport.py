"""The cpu device's KV transports: ``tcp`` (bytes on the channel's socket) and ``shm`` (same host).

``tcp``: the gathered blocks travel as one frame of the prefill/decode channel's message (ZMQ
over TCP), covered by the message's HMAC tag; ZMQ's I/O thread writes them while the engine
computes its next step.

``shm``: the sender gathers the blocks straight into a fresh file in ``/dev/shm`` (created
``O_EXCL``, mode 0600: only this user's processes can open it) and sends only its name; the
receiver maps it, writes the blocks into its cache and unlinks it. No KV byte crosses a
socket. A file the receiver never took (it died, or dropped the request) is unlinked by the
sender after :data:`SHM_ORPHAN_S` seconds and when it stops. The bytes in the file are not
covered by the HMAC tag (the name and sizes are): whoever can write another user's-0600 file
already runs as that user.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from typing import Any

import numpy as np

from fastdeploy_core.devices.kv_transport import KVTransport

SHM_DIR = "/dev/shm"
SHM_PREFIX = "fastdeploy-kv-"
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
#: Seconds after which the sender removes a segment the receiver has not taken.
SHM_ORPHAN_S = 120.0


class TcpKVTransport(KVTransport):
    """Block bytes as a frame of the channel's (authenticated) message."""

    name = "tcp"
    same_host_only = False

    def buffer(self, nbytes: int, transfer_id: str) -> tuple[np.ndarray, dict[str, Any]]:
        return np.empty(nbytes, dtype=np.uint8), {}

    def send(self, buffer: np.ndarray, handle: dict[str, Any]) -> tuple[dict[str, Any], list]:
        self.bytes_sent += buffer.nbytes
        self.batches_sent += 1
        return {"nbytes": int(buffer.nbytes)}, [buffer]

    def receive(self, description: dict[str, Any], frames: list) -> np.ndarray:
        if len(frames) != 1:
            raise ValueError(f"a tcp KV batch comes as one frame, got {len(frames)}")
        data = np.frombuffer(frames[0], dtype=np.uint8)
        if data.nbytes != description.get("nbytes"):
            raise ValueError(f"a tcp KV batch announced {description.get('nbytes')} bytes and carried {data.nbytes}")
        self.bytes_received += data.nbytes
        self.batches_received += 1
        return data


class ShmKVTransport(KVTransport):
    """Block bytes in a ``/dev/shm`` file the receiver maps (same host only)."""

    name = "shm"
    same_host_only = True

    def __init__(self) -> None:
        super().__init__()
        if not os.path.isdir(SHM_DIR):
            from fastdeploy_core.errors import ConfigError

            raise ConfigError(f"cache_transfer_protocol: shm needs {SHM_DIR}, which this host lacks; use tcp",
                              param="cache_transfer_protocol")
        self._pending: dict[str, float] = {}  # segment path -> when it was sent
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray]] = {}

    def buffer(self, nbytes: int, transfer_id: str) -> tuple[np.ndarray, dict[str, Any]]:
        self._sweep()
        name = SHM_PREFIX + secrets.token_hex(12)
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(1, nbytes))
            # Every page mapped in one call, instead of one fault per page while the blocks are written.
            mapped = mmap.mmap(fd, max(1, nbytes), flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
        self._pending[path] = time.monotonic()
        view = np.frombuffer(mapped, dtype=np.uint8, count=nbytes)
        return view, {"segment": name, "nbytes": nbytes, "map": mapped}

    def send(self, buffer: np.ndarray, handle: dict[str, Any]) -> tuple[dict[str, Any], list]:
        del buffer
        handle.pop("map")  # the receiver maps the file itself; this mapping goes with the last view
        self.bytes_sent += handle["nbytes"]
        self.batches_sent += 1
        return {"segment": handle["segment"], "nbytes": int(handle["nbytes"])}, []

    def receive(self, description: dict[str, Any], frames: list) -> np.ndarray:
        name = str(description.get("segment", ""))
        if frames or not name.startswith(SHM_PREFIX) or "/" in name or not name[len(SHM_PREFIX):].isalnum():
            raise ValueError("a shm KV batch names one segment of this transport and carries no frames")
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        nbytes = int(description.get("nbytes", size))
        data = np.frombuffer(mapped, dtype=np.uint8, count=nbytes)
        self._maps[name] = (mapped, data)
        self.bytes_received += nbytes
        self.batches_received += 1
        return data

    def release(self, description: dict[str, Any]) -> None:
        name = str(description.get("segment", ""))
        held = self._maps.pop(name, None)
        if held is not None:
            mapped, data = held
            del data
            try:
                mapped.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes with it
                pass
        if name.startswith(SHM_PREFIX) and "/" not in name:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass

    def _sweep(self, older_than: float = SHM_ORPHAN_S) -> None:
        now = time.monotonic()
        for path, sent in list(self._pending.items()):
            if now - sent >= older_than:
                self._pending.pop(path)
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass  # the receiver took it

    def close(self) -> None:
        self._sweep(older_than=0.0)
        for name in list(self._maps):
            self.release({"segment": name})
