"""The router's signatures: registrations and pairings verify only with the shared secret."""

from __future__ import annotations

import time

from fastdeploy_core.router import security


def test_registration_signature_checks_key_body_and_freshness():
    key = security.router_key("s3cret")
    body = b'{"role":"mixed"}'
    headers = security.signed_headers(key, security.REGISTER_LABEL, body)
    stamp, sig = headers[security.TIMESTAMP_HEADER], headers[security.SIGNATURE_HEADER]
    assert security.check_signature(key, security.REGISTER_LABEL, body, stamp, sig) is None
    assert security.check_signature(key, security.REGISTER_LABEL, body + b" ", stamp, sig) == "bad signature"
    other = security.router_key("other")
    assert security.check_signature(other, security.REGISTER_LABEL, body, stamp, sig) == "bad signature"
    assert security.check_signature(key, security.REGISTER_LABEL, body, None, None) == "missing"
    assert security.check_signature(key, security.REGISTER_LABEL, body, stamp, "zz") == "malformed"
    late = time.time() + 2 * security.MAX_SKEW_S
    assert "timestamp" in security.check_signature(key, security.REGISTER_LABEL, body, stamp, sig, now=late)


def test_pairing_is_bound_to_the_request_body():
    key = security.router_key("s3cret")
    headers = security.pairing_headers(key, '{"prefill":"h:1"}', b"body")
    pairing, sig = headers[security.PAIRING_HEADER], headers[security.PAIRING_SIGNATURE_HEADER]
    assert security.check_pairing(key, pairing, sig, b"body") is None
    assert security.check_pairing(key, pairing, sig, b"other body") == "bad pairing signature"
    assert security.check_pairing(key, '{"prefill":"evil:1"}', sig, b"body") == "bad pairing signature"


def test_secret_sources_in_order(monkeypatch):
    monkeypatch.delenv(security.ROUTER_SECRET_ENV, raising=False)
    assert security.resolve_secret(None, None) is None
    assert security.resolve_secret(None, ["k1"]) == "api-key:k1"
    monkeypatch.setenv(security.ROUTER_SECRET_ENV, "from-env")
    assert security.resolve_secret(None, ["k1"]) == "from-env"
    assert security.resolve_secret("flag", ["k1"]) == "flag"
    # The key is derived for the router alone: not the secret itself, not another purpose's key.
    from fastdeploy_core.sealing import derive_key

    assert security.router_key("x") not in (b"x", derive_key("x", "another purpose"))
