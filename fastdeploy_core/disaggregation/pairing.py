"""The router's pairing of a request with its prefill instance, as a decode instance receives it.

In splitwise mode the router sends a request to a decode instance with the chosen prefill
instance in the ``X-FD-Disaggregate`` header (JSON: ``prefill`` is its KV channel's
``host:port``, ``prefill_address`` its HTTP address, ``protocols`` the transports it offers)
and an HMAC tag over a timestamp, the header and the request body, keyed from the router's
shared secret (``router.security.router_key``). Without the tag a client could make a decode
instance connect to an address of its choosing; bound to the body, a tag cannot be moved to
another request. Standard library only: the router (signing) and the decode instance's API
process (checking) both use it.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastdeploy_core.sealing import derive_key, is_stale, sign, verify

PAIRING_LABEL = b"fastdeploy-router-pairing/1"
PAIRING_HEADER = "X-FD-Disaggregate"
PAIRING_SIGNATURE_HEADER = "X-FD-Disaggregate-Signature"


def router_key(secret: str) -> bytes:
    """The key of the router's registrations and pairings, from the shared secret."""
    return derive_key(secret, "router")


def pairing_headers(key: bytes, pairing: str, request_body: bytes) -> dict[str, str]:
    """Headers handing a decode instance its prefill instance, bound to this request's body."""
    stamp = f"{time.time():.3f}"
    tag = sign(key, PAIRING_LABEL, stamp.encode(), pairing.encode(), request_body)
    return {PAIRING_HEADER: pairing, PAIRING_SIGNATURE_HEADER: f"{stamp}:{tag.hex()}"}


def check_pairing(key: bytes, pairing: str, signature: str, request_body: bytes) -> str | None:
    """None when the pairing header was signed by the router for this body; else why not."""
    stamp, _, tag = signature.partition(":")
    try:
        raw = bytes.fromhex(tag)
        when = float(stamp)
    except ValueError:
        return "malformed pairing signature"
    if not verify(key, PAIRING_LABEL, raw, stamp.encode(), pairing.encode(), request_body):
        return "bad pairing signature"
    if is_stale(when):
        return "stale pairing signature"
    return None


def parse_pairing(pairing: str) -> dict[str, Any]:
    """The checked header as the decode side's connector takes it; ValueError when malformed."""
    data = json.loads(pairing)
    if not isinstance(data, dict) or not isinstance(data.get("prefill"), str):
        raise ValueError("the pairing names no prefill endpoint")
    protocols = data.get("protocols") or []
    if not isinstance(protocols, list) or not all(isinstance(p, str) for p in protocols):
        raise ValueError("the pairing's protocols are not a list of names")
    return {"prefill": data["prefill"], "prefill_address": str(data.get("prefill_address") or ""),
            "protocols": protocols}
