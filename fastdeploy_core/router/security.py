"""The router's shared secret and what it signs.

Two things cross the network on the router's word and so carry an HMAC tag made with a key
derived from one secret shared by the router and its instances:

* registrations (``POST /register``): without the tag, anyone who reaches the router could
  register an address of their choosing and receive users' prompts;
* the pairing of a request with its prefill instance, which the router hands a decode instance
  in the ``X-FD-Disaggregate`` header: without the tag, a client could make a decode instance
  connect to any address.

Each tag covers a timestamp, and a tag older than :data:`~fastdeploy_core.sealing.MAX_SKEW_S` is refused, so a captured
registration cannot be replayed later. The secret is ``--router-secret``, else env
``FD_ROUTER_SECRET``, else derived from the first ``--api-key`` (every instance and the router
then share it by construction). The key is derived for this one purpose
(:func:`fastdeploy_core.sealing.derive_key`), so a future channel keyed from the same secret
gets another key.
"""

from __future__ import annotations

import os
import time

from fastdeploy_core.disaggregation.pairing import (  # noqa: F401 - the pairing is signed here, checked there
    PAIRING_HEADER,
    PAIRING_LABEL,
    PAIRING_SIGNATURE_HEADER,
    check_pairing,
    pairing_headers,
    router_key,
)
from fastdeploy_core.errors import ConfigError
from fastdeploy_core.sealing import MAX_SKEW_S, is_stale, sign, verify

ROUTER_SECRET_ENV = "FD_ROUTER_SECRET"

REGISTER_LABEL = b"fastdeploy-router-register/1"

SIGNATURE_HEADER = "X-FD-Signature"
TIMESTAMP_HEADER = "X-FD-Timestamp"


def resolve_secret(secret: str | None, api_keys: list[str] | None = None) -> str | None:
    """The shared secret: the flag, else ``FD_ROUTER_SECRET``, else the first API key, else None."""
    if secret:
        return secret
    env = os.environ.get(ROUTER_SECRET_ENV, "").strip()
    if env:
        return env
    if api_keys:
        return "api-key:" + api_keys[0]
    return None


def require_secret(secret: str | None, api_keys: list[str] | None, what: str) -> str:
    """:func:`resolve_secret`, or a ConfigError naming the three ways to give one."""
    found = resolve_secret(secret, api_keys)
    if not found:
        raise ConfigError(
            f"{what} needs a shared secret so that only your instances can register and pair: pass "
            f"--router-secret (or set env {ROUTER_SECRET_ENV}), the same on the router and every instance, "
            "or give them the same --api-key",
            param="router_secret",
        )
    return found


def signed_headers(key: bytes, label: bytes, body: bytes, now: float | None = None) -> dict[str, str]:
    """The timestamp and signature headers for ``body``."""
    stamp = f"{now if now is not None else time.time():.3f}"
    return {TIMESTAMP_HEADER: stamp, SIGNATURE_HEADER: sign(key, label, stamp.encode(), body).hex()}


def check_signature(key: bytes, label: bytes, body: bytes, stamp: str | None, signature: str | None,
                    now: float | None = None) -> str | None:
    """None when ``signature`` is valid and fresh for ``body``; else why it is not."""
    if not stamp or not signature:
        return "missing"
    try:
        tag = bytes.fromhex(signature)
        when = float(stamp)
    except ValueError:
        return "malformed"
    if not verify(key, label, tag, stamp.encode(), body):
        return "bad signature"
    if is_stale(when, now):
        return f"timestamp more than {MAX_SKEW_S:.0f} s away from the router's clock"
    return None
