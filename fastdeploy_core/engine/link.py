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

import json
import logging
from typing import Any

from fastdeploy_core.engine.outputs import EngineCoreOutput, EngineCoreRequest
from fastdeploy_core.sealing import MAX_LOGGED_PEERS, SECRET_BYTES, FrameSealer, new_secret

__all__ = ["MAX_LOGGED_PEERS", "SECRET_BYTES", "LinkEnd", "decode_message", "encode_message", "new_secret"]

logger = logging.getLogger("fastdeploy.engine_link")

_DIRECTION = {"api": b"fastdeploy-engine-link/1 api->core", "core": b"fastdeploy-engine-link/1 core->api"}


class LinkEnd(FrameSealer):
    """One side (``"api"`` or ``"core"``) of the link: seals what it sends, opens what it receives.

    ``open`` returns None for any frame that is not an authentic, fresh message from the other
    side; nothing in such a frame is decoded. The sealing is :class:`fastdeploy_core.sealing.FrameSealer`'s.
    """

    def __init__(self, secret: bytes, side: str):
        if side not in _DIRECTION:
            raise ValueError(f"side must be 'api' or 'core', got {side!r}")
        if len(secret) < SECRET_BYTES:
            raise ValueError(f"the link secret must have at least {SECRET_BYTES} bytes")
        other = "core" if side == "api" else "api"
        super().__init__(secret, _DIRECTION[side], _DIRECTION[other], "engine link", logger)

    def __repr__(self) -> str:  # the secret must never reach a log line
        return f"LinkEnd(send={self._send_label.decode()!r}, rejected={self.rejected})"

    def seal(self, msg: tuple) -> list[bytes]:
        """The frames that carry ``msg`` to the other side."""
        return self.seal_body(encode_message(msg))

    def open(self, frames: list[bytes], peer: str) -> tuple | None:
        """The message in ``frames`` if the other side sealed it and it is new; else None."""
        return self.open_body(frames, peer, decode_message)


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
