"""The wire format of the API-process / engine-core link: authenticated frames of plain JSON.

The link is a TCP socket on 127.0.0.1, and any local process can connect to a port on
127.0.0.1. So the socket itself proves nothing about who is talking; every frame does:

* The API process draws a fresh 32-byte secret per launch (:func:`new_secret`) and hands it to
  the core process through the spawn arguments (a pipe, not the command line or environment).
  It is never logged and never reported by ``/config-info``.
* A message travels as three frames ``[seq, tag, body]``: ``seq`` is an 8-byte big-endian
  counter that only grows, ``tag`` is HMAC-SHA256 over the direction (API -> core differs from
  core -> API, so a frame cannot be reflected back), ``seq`` and ``body``. The receiver checks
  the tag with :func:`hmac.compare_digest` and refuses a ``seq`` it has already passed, before
  it looks at the body at all.
* The body is JSON of builtins. Nothing on the link is unpickled, so even an authenticated but
  malformed frame can only fail to decode; it cannot run code.

A frame that fails any check is dropped and counted (:attr:`LinkEnd.rejected`); the first one
from each peer is logged, so a stranger probing the port shows up in the log once, not once per
frame, and the real link keeps flowing.

Messages are the tuples described in :mod:`fastdeploy_core.engine.core_process`; the ones that
carry dataclasses (``add``, ``outputs``) are converted with their ``to_dict`` / ``from_dict``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
from typing import Any

from fastdeploy_core.engine.outputs import EngineCoreOutput, EngineCoreRequest

logger = logging.getLogger("fastdeploy.engine_link")

#: Length of the per-launch secret, in bytes.
SECRET_BYTES = 32

#: Peers whose first rejected frame is logged; past this many a flood of fresh connections
#: is only counted, so it cannot fill the log.
MAX_LOGGED_PEERS = 64

_DIRECTION = {"api": b"fastdeploy-engine-link/1 api->core", "core": b"fastdeploy-engine-link/1 core->api"}
_SEQ_BYTES = 8


def new_secret() -> bytes:
    """A fresh random key for one launch of the engine core."""
    return secrets.token_bytes(SECRET_BYTES)


class LinkEnd:
    """One side (``"api"`` or ``"core"``) of the link: seals what it sends, opens what it receives.

    ``open`` returns None for any frame that is not an authentic, fresh message from the other
    side; nothing in such a frame is decoded.
    """

    def __init__(self, secret: bytes, side: str):
        if side not in _DIRECTION:
            raise ValueError(f"side must be 'api' or 'core', got {side!r}")
        if len(secret) < SECRET_BYTES:
            raise ValueError(f"the link secret must have at least {SECRET_BYTES} bytes")
        self._secret = secret
        self._send_label = _DIRECTION[side]
        self._recv_label = _DIRECTION["core" if side == "api" else "api"]
        self._send_seq = 0
        self._recv_seq = 0
        self._logged_peers: set[str] = set()
        self.rejected = 0

    def __repr__(self) -> str:  # the secret must never reach a log line
        return f"LinkEnd(send={self._send_label.decode()!r}, rejected={self.rejected})"

    def _tag(self, label: bytes, seq: bytes, body: bytes) -> bytes:
        mac = hmac.new(self._secret, label, hashlib.sha256)
        mac.update(seq)
        mac.update(body)
        return mac.digest()

    def seal(self, msg: tuple) -> list[bytes]:
        """The frames that carry ``msg`` to the other side."""
        body = encode_message(msg)
        self._send_seq += 1
        seq = self._send_seq.to_bytes(_SEQ_BYTES, "big")
        return [seq, self._tag(self._send_label, seq, body), body]

    def open(self, frames: list[bytes], peer: str) -> tuple | None:
        """The message in ``frames`` if the other side sealed it and it is new; else None."""
        if len(frames) != 3 or len(frames[0]) != _SEQ_BYTES:
            return self._reject(peer, "not a link frame")
        seq, tag, body = frames
        if not hmac.compare_digest(tag, self._tag(self._recv_label, seq, body)):
            return self._reject(peer, "bad authentication tag")
        number = int.from_bytes(seq, "big")
        if number <= self._recv_seq:
            return self._reject(peer, "replayed frame")
        try:
            msg = decode_message(body)
        except Exception as exc:  # noqa: BLE001 - authentic but undecodable: a bug, not an attack
            # e.g. the two processes run different versions of this module.
            return self._reject(peer, f"undecodable body ({type(exc).__name__}: {exc})")
        self._recv_seq = number
        return msg

    def _reject(self, peer: str, reason: str) -> None:
        self.rejected += 1
        if peer not in self._logged_peers and len(self._logged_peers) < MAX_LOGGED_PEERS:
            self._logged_peers.add(peer)
            logger.warning(
                "engine link: dropped a frame from %s (%s); only the engine's own peer may use this socket, "
                "further frames from that peer are dropped without a log line",
                peer,
                reason,
            )


# ---- messages <-> JSON -----------------------------------------------------------------------


def encode_message(msg: tuple) -> bytes:
    """JSON of ``msg`` with its dataclasses turned into dicts."""
    kind, *args = msg
    if kind == "add":
        args = [args[0].to_dict()]
    elif kind == "outputs":
        args = [[o.to_dict() for o in args[0]], args[1]]
    return json.dumps([kind, *args], separators=(",", ":")).encode()


def decode_message(body: bytes) -> tuple:
    """Inverse of :func:`encode_message` (JSON turned the logprob dicts' int keys into strings)."""
    kind, *args = json.loads(body)
    if not isinstance(kind, str):
        raise TypeError("a message starts with its kind")
    if kind == "add":
        args = [EngineCoreRequest.from_dict(args[0])]
    elif kind == "outputs":
        args = [[_output_from_wire(o) for o in args[0]], args[1]]
    return (kind, *args)


def _int_keys(entry: dict[str, Any] | None) -> dict[int, Any] | None:
    return None if entry is None else {int(k): v for k, v in entry.items()}


def _output_from_wire(data: dict[str, Any]) -> EngineCoreOutput:
    data = dict(data)
    if data.get("new_logprobs") is not None:
        data["new_logprobs"] = [_int_keys(e) for e in data["new_logprobs"]]
    if data.get("prompt_logprobs") is not None:
        data["prompt_logprobs"] = [_int_keys(e) for e in data["prompt_logprobs"]]
    return EngineCoreOutput.from_dict(data)
