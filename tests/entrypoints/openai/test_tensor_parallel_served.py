"""``fastdeploy serve -tp 2``: two rank processes under the engine core answer as one rank does,
holding no socket but their anonymous pair to the core; a killed rank ends the engine (error
event in flight, 503 after) and leaves no process behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.conftest import start_server

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(child) for child in f.read().split()]
    return found


def _sockets(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_tp2_server_answers_and_a_killed_rank_gives_errors_then_503(tmp_path):
    srv = start_server(str(tmp_path), "--tensor-parallel-size", "2")
    try:
        info = httpx.get(f"{srv.url}/config-info", headers=srv.headers()).json()
        assert info["engine"]["tensor_parallel_size"] == 2 and info["engine"]["collectives"] == "shared memory"
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
                "temperature": 0}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=srv.headers(), timeout=120)
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]

        ranks = _children(info["engine_core_pid"])
        assert len(ranks) == 2, ranks
        for pid in ranks:  # one socket each: its end of the anonymous pair to the engine core
            assert _sockets(pid) == 1, pid
        events: list[str] = []

        def stream():
            long = {"prompt": "A long story:", "max_tokens": 400, "min_tokens": 399, "stream": True}
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=long, headers=srv.headers(), timeout=60) as s:
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 30
        while len(events) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(events) >= 3, "the stream never started"
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        t.join(30)
        assert not t.is_alive()
        assert time.monotonic() - killed < 10
        assert any('"engine_dead"' in e for e in events), events[-3:]
        after = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=srv.headers(), timeout=30)
        assert after.status_code == 503, after.text
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in ranks), "a rank process outlived the engine"
        assert "rank 1 died" in srv.log()
    finally:
        srv.stop()
