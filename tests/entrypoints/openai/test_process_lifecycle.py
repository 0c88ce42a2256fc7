"""The engine core process: a killed core is reported (503, errors, log), shutdown is clean."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.conftest import port_is_free, start_server

pytestmark = pytest.mark.slow


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_sigterm_stops_server_and_core_and_frees_ports(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("served-model-name: from-preset\nmax-concurrency: 7\nmax_model_len: 256\nmax-num-seqs: 3\n")
    # --max-model-len 512 on the command line (start_server) wins over the preset's 256
    srv = start_server(str(tmp_path), "--config", str(preset))
    info = httpx.get(f"{srv.url}/config-info", headers=srv.headers()).json()
    assert info["served_model_name"] == "from-preset"
    assert info["server"]["max_concurrency"] == 7
    assert info["engine_args"]["max_num_seqs"] == 8  # start_server's --max-num-seqs 8 wins
    assert info["max_model_len"] == 512
    models = httpx.get(f"{srv.url}/v1/models", headers=srv.headers()).json()
    assert [m["id"] for m in models["data"]] == ["from-preset"]
    core_pid, core_port = info["engine_core_pid"], info["engine_worker_queue_port"]
    assert core_pid != srv.proc.pid and _pid_alive(core_pid)
    # a request in flight while the signal arrives must not keep the server up
    body = {"prompt": "A long story:", "max_tokens": 300, "min_tokens": 299, "stream": True}
    client = httpx.Client(timeout=60)
    resp = client.send(client.build_request("POST", f"{srv.url}/v1/completions", json=body,
                                            headers=srv.headers()), stream=True)
    next(resp.iter_lines())
    t0 = time.monotonic()
    code = srv.stop(signal.SIGTERM, timeout=30)
    resp.close()
    client.close()
    # uvicorn re-raises the signal after its graceful shutdown, so the status may say SIGTERM
    assert code in (0, -signal.SIGTERM), srv.log()[-3000:]
    assert "Application shutdown complete" in srv.log()
    assert time.monotonic() - t0 < 20
    assert _wait_gone(core_pid, 5), "engine core orphaned"
    assert port_is_free(srv.port)
    assert port_is_free(core_port)
    assert "engine core stopped" in srv.log()


def test_killed_engine_core_gives_503_and_errors_in_flight(tmp_path):
    # two engine slots, so a third request waits for one and gives up after 1 s
    srv = start_server(str(tmp_path), "--max-num-seqs", "2", "--max-waiting-time", "1")
    core_pid = httpx.get(f"{srv.url}/config-info", headers=srv.headers()).json()["engine_core_pid"]
    results: dict[str, object] = {}

    def non_streaming():
        body = {"prompt": "A long story:", "max_tokens": 400, "min_tokens": 399}
        results["plain"] = httpx.post(f"{srv.url}/v1/completions", json=body, headers=srv.headers(), timeout=60)

    def streaming():
        body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 400,
                "min_tokens": 399, "stream": True}
        events = []
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, headers=srv.headers(),
                          timeout=60) as r:
            results["stream_status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        results["stream"] = events

    threads = [threading.Thread(target=non_streaming), threading.Thread(target=streaming)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = [ln for ln in httpx.get(f"{srv.url}/metrics").text.splitlines()
                   if ln.startswith("fastdeploy:num_requests_running")]
        if running and float(running[0].split()[-1]) >= 2:
            break
        time.sleep(0.05)
    t0 = time.monotonic()
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   headers=srv.headers(), timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout", r.text
    assert 0.9 < time.monotonic() - t0 < 10
    os.kill(core_pid, signal.SIGKILL)
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "an in-flight request hangs after the engine died"

    plain = results["plain"]
    assert plain.status_code == 503
    assert plain.json()["error"]["code"] == "engine_dead"
    assert results["stream_status"] == 200  # headers were sent before the core died
    events = results["stream"]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead" and "killed by signal 9" in error["message"]

    health = httpx.get(f"{srv.url}/health")
    assert health.status_code == 503
    assert health.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(f"{srv.url}/ping").status_code == 503
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   headers=srv.headers(), timeout=10)
    assert r.status_code == 503
    assert "killed by signal 9" in srv.log()

    # SIGINT (Ctrl-C) still shuts the API process down cleanly, port freed
    assert srv.stop(signal.SIGINT, timeout=30) in (0, 130, -signal.SIGINT)  # 130: exit after KeyboardInterrupt
    assert "Application shutdown complete" in srv.log()
    assert port_is_free(srv.port)
