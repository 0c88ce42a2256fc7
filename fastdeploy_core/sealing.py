"""HMAC sealing shared by every authenticated channel between our processes.

Two channels use it: the engine link (API process <-> engine core, :mod:`engine.link`) and the
router's registrations and pairings (:mod:`router.security`). They differ in who holds the key
and what the body is; what they share lives here, once:

* :class:`FrameSealer` turns a body into three frames ``[seq, tag, body]``. ``seq`` is an 8-byte
  big-endian counter that only grows; ``tag`` is HMAC-SHA256 over a direction label (so a frame
  cannot be reflected back to its sender), ``seq`` and ``body``. :meth:`FrameSealer.open` checks
  the tag with :func:`hmac.compare_digest` and refuses a ``seq`` it has already passed before
  the body is handed to the decoder, so a stranger's bytes are never parsed.
* :func:`sign` / :func:`verify` tag a message made of several parts (an HTTP body and its
  timestamp, say), each part length-prefixed so that moving bytes from one part to the next
  changes the tag.
* :func:`is_stale` bounds how long a timestamped tag stays valid (:data:`MAX_SKEW_S`), for the
  router's registrations and pairings and the prefill/decode channel alike.
* :func:`derive_key` turns a shared secret (a flag, an environment variable or an API key) into
  a key for one purpose, so one secret never keys two channels the same way.

Bodies are JSON everywhere; nothing that passes through here is ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

#: Length of a generated secret and the shortest key a sealer accepts, in bytes.
SECRET_BYTES = 32

#: Peers whose first rejected frame is logged; past this many a flood of fresh connections
#: is only counted, so it cannot fill the log.
MAX_LOGGED_PEERS = 64

SEQ_BYTES = 8

#: Seconds a timestamped tag stays valid, clock skew between hosts included.
MAX_SKEW_S = 60.0


def new_secret() -> bytes:
    """A fresh random key."""
    return secrets.token_bytes(SECRET_BYTES)


def derive_key(material: str | bytes, purpose: str) -> bytes:
    """A 32-byte key for ``purpose`` from a shared secret of any length."""
    if isinstance(material, str):
        material = material.encode()
    return hmac.new(material, b"fastdeploy-key/1 " + purpose.encode(), hashlib.sha256).digest()


def sign(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over ``label`` and each of ``parts`` (length-prefixed)."""
    mac = hmac.new(key, label, hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.digest()


def verify(key: bytes, label: bytes, tag: bytes, *parts: bytes) -> bool:
    """Whether ``tag`` is :func:`sign` of the same label and parts (constant-time compare)."""
    return hmac.compare_digest(tag, sign(key, label, *parts))


def is_stale(when: float, now: float | None = None) -> bool:
    """Whether a tag stamped ``when`` (seconds since the epoch) is more than :data:`MAX_SKEW_S`
    away from ``now`` (this host's clock by default), in either direction."""
    return abs((time.time() if now is None else now) - when) > MAX_SKEW_S


class FrameSealer:
    """One side of a sealed frame channel: seals what it sends, opens only what the peer sealed.

    ``send_label`` and ``recv_label`` name the two directions; the peer uses them swapped.
    ``log_name`` starts the one warning logged per stranger (``"engine link"``, ...).
    """

    def __init__(self, secret: bytes, send_label: bytes, recv_label: bytes, log_name: str, logger: logging.Logger):
        if len(secret) < SECRET_BYTES:
            raise ValueError(f"a channel secret must have at least {SECRET_BYTES} bytes")
        if send_label == recv_label:
            raise ValueError("the two directions of a channel need different labels")
        self._secret = secret
        self._send_label = send_label
        self._recv_label = recv_label
        self._send_seq = 0
        self._recv_seq = 0
        self._log_name = log_name
        self._logger = logger
        self._logged_peers: set[str] = set()
        self.rejected = 0

    def __repr__(self) -> str:  # the secret must never reach a log line
        return f"{type(self).__name__}(send={self._send_label.decode()!r}, rejected={self.rejected})"

    def _tag(self, label: bytes, seq: bytes, body: bytes) -> bytes:
        mac = hmac.new(self._secret, label, hashlib.sha256)
        mac.update(seq)
        mac.update(body)
        return mac.digest()

    def seal_body(self, body: bytes) -> list[bytes]:
        """The frames that carry ``body`` to the other side."""
        self._send_seq += 1
        seq = self._send_seq.to_bytes(SEQ_BYTES, "big")
        return [seq, self._tag(self._send_label, seq, body), body]

    def open_body(self, frames: list[bytes], peer: str, decode: Callable[[bytes], Any]) -> Any | None:
        """``decode(body)`` if the other side sealed ``frames`` and they are new; else None."""
        if len(frames) != 3 or len(frames[0]) != SEQ_BYTES:
            return self.reject(peer, "not a sealed frame")
        seq, tag, body = frames
        if not hmac.compare_digest(tag, self._tag(self._recv_label, seq, body)):
            return self.reject(peer, "bad authentication tag")
        number = int.from_bytes(seq, "big")
        if number <= self._recv_seq:
            return self.reject(peer, "replayed frame")
        try:
            msg = decode(body)
        except Exception as exc:  # noqa: BLE001 - authentic but undecodable: a bug, not an attack
            # e.g. the two processes run different versions of this module.
            return self.reject(peer, f"undecodable body ({type(exc).__name__}: {exc})")
        self._recv_seq = number
        return msg

    def reject(self, peer: str, reason: str) -> None:
        """Count a refused frame; log the first one from each peer."""
        self.rejected += 1
        if peer not in self._logged_peers and len(self._logged_peers) < MAX_LOGGED_PEERS:
            self._logged_peers.add(peer)
            self._logger.warning(
                "%s: dropped a frame from %s (%s); only the channel's own peer may use this socket, "
                "further frames from that peer are dropped without a log line",
                self._log_name,
                peer,
                reason,
            )
