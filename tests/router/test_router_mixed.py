"""The router in front of two mixed instances, all real processes on 127.0.0.1.

Round robin spreads requests evenly, streaming passes through chunk by chunk, registrations
without the shared secret are refused, and when one instance is SIGKILLed its traffic goes to
the other.
"""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from fastdeploy_core.router import security
from tests.entrypoints.openai.conftest import API_KEY, start_server
from tests.router.conftest import ROUTER_SECRET, start_router

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("router"))
    router = start_router(tmp, "--policy", "round_robin")
    servers = []
    try:
        for _ in range(2):
            servers.append(start_server(tmp, "--router", f"127.0.0.1:{router.port}", "--router-secret", ROUTER_SECRET))
        router.wait_for(timeout=60, mixed=2)
        yield router, servers
    finally:
        for srv in servers:
            srv.stop()
        router.stop()


def complete(router, prompt: str = "The capital of France is", max_tokens: int = 5) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/completions", headers=AUTH, timeout=120,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_round_robin_spreads_requests_and_answers_agree(cluster):
    router, servers = cluster
    before = router.metrics()
    texts = []
    for _ in range(4):
        resp = complete(router)
        assert resp.status_code == 200, resp.text
        texts.append(resp.json()["choices"][0]["text"])
    after = router.metrics()
    for srv in servers:
        name = f'fastdeploy_router:routed_total{{instance="127.0.0.1:{srv.port}"}}'
        assert after[name] - before.get(name, 0) == 2
    assert len(set(texts)) == 1 and texts[0]
    direct = httpx.post(f"{servers[0].url}/v1/completions", headers=AUTH, timeout=120,
                        json={"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0})
    assert direct.json()["choices"][0]["text"] == texts[0]


def test_streaming_passes_through_chunk_by_chunk(cluster):
    router, _ = cluster
    body = {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 8, "temperature": 0}
    plain = httpx.post(f"{router.url}/v1/chat/completions", headers=AUTH, json=body, timeout=120)
    assert plain.status_code == 200, plain.text
    events = []
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", headers=AUTH, timeout=120,
                      json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 3
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == plain.json()["choices"][0]["message"]["content"]


def test_client_api_key_reaches_the_instances(cluster):
    router, _ = cluster
    resp = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60)
    assert resp.status_code == 401
    models = httpx.get(f"{router.url}/v1/models", headers=AUTH, timeout=30)
    assert models.status_code == 200 and models.json()["data"]


def _register(router, body: dict, secret: str | None) -> httpx.Response:
    raw = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if secret is not None:
        headers.update(security.signed_headers(security.router_key(secret), security.REGISTER_LABEL, raw))
    return httpx.post(f"{router.url}/register", content=raw, headers=headers, timeout=10)


def test_registrations_without_the_secret_or_with_bad_fields_are_refused(cluster):
    router, _ = cluster
    good = {"role": "mixed", "host": "127.0.0.1", "port": 1}
    unsigned = _register(router, good, None)
    assert unsigned.status_code == 401 and "missing signature" in unsigned.json()["error"]["message"]
    assert _register(router, good, "wrong-secret").status_code == 403
    missing = _register(router, {"role": "mixed", "host": "127.0.0.1"}, ROUTER_SECRET)
    assert missing.status_code == 400 and "port: Field required" in missing.json()["error"]["message"]
    wrong_role = _register(router, {**good, "role": "prefill", "transfer_endpoint": "h:1"}, ROUTER_SECRET)
    assert wrong_role.status_code == 400 and "does not serve behind a mixed router" in wrong_role.text
    bad_role = _register(router, {**good, "role": "worker"}, ROUTER_SECRET)
    assert bad_role.status_code == 400
    assert router.counts()["mixed"] == 2  # nothing above was registered


def test_a_killed_instance_traffic_goes_to_the_other(cluster):
    router, servers = cluster
    victim, survivor = servers
    victim.stop(signal.SIGKILL)
    for _ in range(3):
        resp = complete(router, max_tokens=2)
        assert resp.status_code == 200, resp.text
    assert router.counts()["mixed"] == 1
    assert router.metrics()[f'fastdeploy_router:routed_total{{instance="127.0.0.1:{survivor.port}"}}'] >= 5
