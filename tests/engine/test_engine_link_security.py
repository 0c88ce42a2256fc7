"""The API-process / engine-core link runs nothing a stranger sends and talks only to its own peer.

The attack: any local process can connect to the link's port on 127.0.0.1 and send a pickle
whose ``__reduce__`` opens a file (it could as well run a shell command). Here it must create no
file, reach nobody, and leave the real link serving completions.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import pickle
import signal
import time

import httpx
import pytest
import zmq

from tests.entrypoints.openai.conftest import free_port, start_server


class _TouchMarker:
    """Unpickling this opens (creates) ``path``: proof that a pickle from a stranger was loaded."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _evil(path) -> bytes:
    return pickle.dumps(("noop", _TouchMarker(str(path))))


# ---- frames, without a server ---------------------------------------------------------------


def _messages():
    from fastdeploy_core.engine.outputs import EngineCoreOutput, EngineCoreRequest
    from fastdeploy_core.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=7, stop=["\n"], logprobs=2, seed=2**64 - 1)
    output = EngineCoreOutput(
        request_id="r1#1",
        index=1,
        new_token_ids=[5, 9],
        new_logprobs=[{5: -0.25, 7: -math.inf}, {9: -1.5}],
        prompt_logprobs=[None, {3: -2.0}],
        finished=True,
        finish_reason="stop",
        stop_reason=42,
        num_cached_tokens=16,
    )
    error = {"message": "bad", "type": "invalid_request_error", "status": 400, "param": "n", "code": None}
    return [
        ("add", EngineCoreRequest("r1", [1, 2, 3], params, arrival_time=1712.5, priority=3)),
        ("abort", ["r1", "r2#0"]),
        ("shutdown",),
        ("ready", {"max_model_len": 512, "pid": 7, "config_info": {"eos_token_ids": [0]}, "stats": {}}),
        ("outputs", [output], {"num_requests_running": 1, "cache_usage": 0.5}),
        ("stats", {"num_requests_running": 0}),
        ("request_error", "r1", error),
        ("dead", error),
        ("startup_failed", error),
    ]


def test_every_message_kind_crosses_the_link_unchanged_in_both_directions():
    from fastdeploy_core.engine.link import LinkEnd, new_secret

    secret = new_secret()
    api, core = LinkEnd(secret, "api"), LinkEnd(secret, "core")
    for msg in _messages():
        assert core.open(api.seal(msg), peer="api") == msg
        assert api.open(core.seal(msg), peer="core") == msg
    assert api.rejected == core.rejected == 0
    assert secret.hex() not in repr(api) and str(secret) not in repr(api)


def test_frames_without_the_launch_secret_are_dropped_before_anything_is_decoded(tmp_path, caplog):
    from fastdeploy_core.engine.link import LinkEnd, new_secret

    secret = new_secret()
    api, core = LinkEnd(secret, "api"), LinkEnd(secret, "core")
    stranger = LinkEnd(new_secret(), "core")
    marker = tmp_path / "pwned"
    seq, tag, _ = stranger.seal(("stats", {}))
    with caplog.at_level(logging.WARNING, logger="fastdeploy.engine_link"):
        # a pickle alone (what pyzmq's send_pyobj sends), and inside a well-formed frame with a wrong tag
        assert api.open([_evil(marker)], peer="A") is None
        assert api.open([seq, tag, _evil(marker)], peer="A") is None
        # a well-formed message sealed with another key
        assert api.open(stranger.seal(("ready", {"max_model_len": 1})), peer="B") is None
        # an authentic frame with its body changed
        seq, tag, body = core.seal(("stats", {"num_requests_running": 1}))
        assert api.open([seq, tag, body.replace(b"1", b"9")], peer="B") is None
        # even with the right secret a pickle body is never loaded (bodies are JSON)
        sealed_pickle = core.seal(("stats", {}))
        sealed_pickle[2] = _evil(marker)
        sealed_pickle[1] = core._tag(b"fastdeploy-engine-link/1 core->api", sealed_pickle[0], sealed_pickle[2])
        assert api.open(sealed_pickle, peer="B") is None
    assert not marker.exists()
    assert api.rejected == 5
    # logged once per peer, not once per frame
    dropped = [r for r in caplog.records if "dropped a frame" in r.getMessage()]
    assert [r.getMessage().split(" from ")[1].split(" ")[0] for r in dropped] == ["A", "B"]

    # the real link still works after all that
    frames = core.seal(("stats", {"num_requests_running": 2}))
    assert api.open(frames, peer="core") == ("stats", {"num_requests_running": 2})
    # a replayed frame, and a frame reflected back to the side that sealed it, are refused
    assert api.open(frames, peer="core") is None
    assert core.open(core.seal(("abort", ["x"])), peer="core") is None
    assert (api.rejected, core.rejected) == (6, 1)


def test_client_socket_answers_only_the_peer_that_holds_the_secret(tmp_path):
    """The API process's ROUTER, without a model: a stranger's frames are dropped, and the
    stranger receives none of the API's messages even while connected."""
    from fastdeploy_core.engine.core_client import EngineCoreClient
    from fastdeploy_core.engine.link import LinkEnd

    marker = tmp_path / "pwned"

    async def scenario():
        client = EngineCoreClient({}, port=None)
        address = client._bind()
        ctx = zmq.Context()
        try:
            stranger = ctx.socket(zmq.DEALER)
            stranger.setsockopt(zmq.LINGER, 0)
            stranger.connect(address)
            core_sock = ctx.socket(zmq.DEALER)
            core_sock.setsockopt(zmq.LINGER, 0)
            core_sock.connect(address)
            core = LinkEnd(client._secret, "core")

            stranger.send(_evil(marker))
            await asyncio.sleep(0.2)
            core_sock.send_multipart(core.seal(("ready", {"max_model_len": 64})))
            assert await asyncio.wait_for(client.recv(), 10) == ("ready", {"max_model_len": 64})
            deadline = time.monotonic() + 5
            while client.rejected_frames < 1 and time.monotonic() < deadline:
                await asyncio.wait_for(client._recv_authentic(), 5)
            assert client.rejected_frames == 1

            for i in range(4):  # a DEALER peer would get every other one of these
                client.send(("abort", [f"r{i}"]))
            got = []
            for _ in range(4):
                assert core_sock.poll(5000), "the real core did not receive the API's message"
                got.append(core.open(core_sock.recv_multipart(), peer="api"))
            assert got == [("abort", [f"r{i}"]) for i in range(4)]
            assert stranger.poll(300) == 0, "a stranger received a message meant for the engine core"
        finally:
            ctx.destroy(linger=0)
            client._sock.close(linger=0)
            client._ctx.term()

    asyncio.run(scenario())
    assert not marker.exists()


# ---- the attack on a real server ------------------------------------------------------------


def _complete(srv, prompt: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{srv.url}/v1/completions", json=body, headers=srv.headers(), timeout=60)


@pytest.mark.slow
def test_pickle_sent_to_the_engine_port_runs_nothing_and_the_server_keeps_serving(tmp_path):
    import psutil

    queue_port = free_port()
    srv = start_server(str(tmp_path), "--engine-worker-queue-port", str(queue_port))
    ctx = zmq.Context()
    try:
        info = httpx.get(f"{srv.url}/config-info", headers=srv.headers(), timeout=10).json()
        assert info["engine_worker_queue_port"] == queue_port
        baseline = _complete(srv, "The capital of France is")
        assert baseline.status_code == 200, baseline.text
        expected = baseline.json()["choices"][0]["text"]

        # the only listening socket of the link is the API process's, on 127.0.0.1; the core binds nothing
        api_listen = [
            c.laddr for c in psutil.Process(srv.proc.pid).net_connections("inet") if c.status == psutil.CONN_LISTEN
        ]
        assert ("127.0.0.1", queue_port) in [(a.ip, a.port) for a in api_listen]
        core_listen = [
            c for c in psutil.Process(info["engine_core_pid"]).net_connections("all") if c.status == psutil.CONN_LISTEN
        ]
        assert core_listen == []

        endpoint = f"tcp://127.0.0.1:{queue_port}"
        markers = [tmp_path / f"pwned-{i}" for i in range(3)]
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send(_evil(markers[0]))
        # shaped like a link frame: sequence number, 32-byte tag, pickle body
        dealer.send_multipart([(1).to_bytes(8, "big"), os.urandom(32), _evil(markers[1])])
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(endpoint)
        req.send(_evil(markers[2]))
        time.sleep(1.0)
        assert [m.name for m in markers if m.exists()] == [], "a stranger's pickle ran code in the server"

        # strangers still connected: every request reaches the real core and answers exactly
        for _ in range(4):
            r = _complete(srv, "The capital of France is")
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        assert dealer.poll(500) == 0, "a stranger received the API process's messages to the core"
        assert req.poll(100) == 0
        assert [m.name for m in markers if m.exists()] == []

        log = srv.log()
        assert log.count("engine link: dropped a frame") == 2, log[-3000:]  # once per peer
    finally:
        ctx.destroy(linger=0)
        code = srv.stop(signal.SIGTERM, timeout=30)
    assert code in (0, -signal.SIGTERM), srv.log()[-3000:]
    assert "engine core stopped" in srv.log()
