"""The prefill/decode channel's messages: a JSON header and raw frames, under one HMAC tag.

Every message between a decode instance's engine core and a prefill instance's travels as the
frames ``[MAGIC, stamp, tag, header, *payload]`` over ZMQ (TCP): ``header`` is JSON of builtins
(never pickle), ``payload`` the KV bytes of a ``tcp`` batch (none for ``shm``, whose bytes never
touch the socket), ``tag`` HMAC-SHA256 over the direction's label, the stamp, the header and
every payload frame (:func:`fastdeploy_core.sealing.sign`), keyed from the router's shared secret
for this purpose only (:func:`channel_key`). A frame set whose tag does not verify, or whose
stamp is more than :data:`~fastdeploy_core.sealing.MAX_SKEW_S` away, is dropped before its header is parsed; the two
directions have different labels, so a message cannot be reflected to its sender. Replays of
fresh messages are refused by what they mean: a prefill instance takes each transfer id once,
a decode instance takes each transfer's messages in their sequence once.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from fastdeploy_core.sealing import MAX_LOGGED_PEERS, derive_key, is_stale, sign, verify

logger = logging.getLogger("fastdeploy.pd_channel")

MAGIC = b"fdpd/1"
TO_PREFILL = b"fastdeploy-pd/1 decode->prefill"
TO_DECODE = b"fastdeploy-pd/1 prefill->decode"


def channel_key(secret: str) -> bytes:
    """The channel's key, derived from the router's shared secret."""
    return derive_key(secret, "pd-kv-channel")


def _raw(frame: Any) -> memoryview | bytes:
    return frame.buffer if hasattr(frame, "buffer") else frame


class Channel:
    """Seals what one side sends and opens only what the other side sealed."""

    def __init__(self, key: bytes, send_label: bytes, recv_label: bytes):
        self._key = key
        self._send = send_label
        self._recv = recv_label
        self.rejected = 0
        self._logged: set[str] = set()

    def __repr__(self) -> str:  # the key must never reach a log line
        return f"Channel(send={self._send.decode()!r}, rejected={self.rejected})"

    def seal(self, header: dict[str, Any], payload: list | tuple = ()) -> list:
        body = json.dumps(header, separators=(",", ":")).encode()
        stamp = f"{time.time():.3f}".encode()
        parts = [memoryview(p).cast("B") if not isinstance(p, bytes) else p for p in payload]
        return [MAGIC, stamp, sign(self._key, self._send, stamp, body, *parts), body, *payload]

    def open(self, frames: list, peer: str) -> tuple[dict[str, Any], list] | None:
        """``(header, payload frames)`` of an authentic, fresh message; else None (counted, logged once)."""
        if len(frames) < 4 or bytes(_raw(frames[0])) != MAGIC:
            return self._reject(peer, "not a channel message")
        stamp, tag, body = (bytes(_raw(f)) for f in frames[1:4])
        payload = [_raw(f) for f in frames[4:]]
        if not verify(self._key, self._recv, tag, stamp, body, *payload):
            return self._reject(peer, "bad authentication tag")
        try:
            when = float(stamp)
        except ValueError:
            return self._reject(peer, "malformed stamp")
        if is_stale(when):
            return self._reject(peer, "stale message")
        try:
            header = json.loads(body)
        except ValueError as exc:
            return self._reject(peer, f"undecodable header ({exc})")
        if not isinstance(header, dict) or not isinstance(header.get("type"), str):
            return self._reject(peer, "a header is an object with a type")
        return header, payload

    def _reject(self, peer: str, reason: str) -> None:
        self.rejected += 1
        if peer not in self._logged and len(self._logged) < MAX_LOGGED_PEERS:
            self._logged.add(peer)
            logger.warning("prefill/decode channel: dropped a message from %s (%s); further ones from that peer "
                           "are dropped without a log line", peer, reason)
        return None
