"""The router's splitwise mode over stand-in instances (httpx mock transport, no processes).

A request goes to a decode instance with the chosen prefill instance's endpoint in a header the
router signed for that body; with no prefill instance left the answer is 503 with the reason.
"""

from __future__ import annotations

import json

import httpx
from fastapi.testclient import TestClient

from fastdeploy_core.router import security
from fastdeploy_core.router.app import RouterConfig, build_app

SECRET = "pairing-secret"


def _register(client: TestClient, body: dict) -> httpx.Response:
    raw = json.dumps(body).encode()
    headers = security.signed_headers(security.router_key(SECRET), security.REGISTER_LABEL, raw)
    return client.post("/register", content=raw, headers={"Content-Type": "application/json", **headers})


def test_decode_instance_receives_a_signed_pairing_and_prefill_loss_is_503():
    seen: list[httpx.Request] = []

    def instance(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        # A stream, as a real instance's answer is: the router relays it chunk by chunk.
        return httpx.Response(200, headers={"content-type": "application/json"},
                              stream=httpx.ByteStream(b'{"choices": [{"text": "ok"}]}'))

    app = build_app(RouterConfig(secret=SECRET, splitwise=True))
    with TestClient(app) as client:
        app.state.router.client = httpx.AsyncClient(transport=httpx.MockTransport(instance))
        assert _register(client, {"role": "mixed", "host": "127.0.0.1", "port": 7001}).status_code == 400
        no_endpoint = _register(client, {"role": "prefill", "host": "127.0.0.1", "port": 7002})
        assert no_endpoint.status_code == 400 and "transfer_endpoint" in no_endpoint.text
        assert _register(client, {"role": "prefill", "host": "127.0.0.1", "port": 7002,
                                  "transfer_endpoint": "127.0.0.1:7102", "protocols": ["tcp"]}).status_code == 200
        assert _register(client, {"role": "decode", "host": "127.0.0.1", "port": 7003}).status_code == 200
        assert client.get("/health").status_code == 200

        body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
        resp = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert resp.status_code == 200 and resp.json() == {"choices": [{"text": "ok"}]}
        (sent,) = seen
        assert str(sent.url) == "http://127.0.0.1:7003/v1/completions"
        pairing = sent.headers[security.PAIRING_HEADER]
        assert json.loads(pairing) == {"prefill": "127.0.0.1:7102", "prefill_address": "127.0.0.1:7002",
                                       "protocols": ["tcp"]}
        key = security.router_key(SECRET)
        assert security.check_pairing(key, pairing, sent.headers[security.PAIRING_SIGNATURE_HEADER], body) is None

        app.state.router.registry.remove("127.0.0.1:7002")
        gone = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert gone.status_code == 503
        assert gone.json()["error"]["message"].startswith("no live prefill instance is registered")
        assert client.get("/health").status_code == 503
