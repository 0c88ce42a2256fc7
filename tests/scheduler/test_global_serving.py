"""Three real ``fastdeploy serve`` instances sharing one real redis-server (slow).

All traffic goes to instance A; B and C are idle and must take a share of it through work
stealing, with responses token-identical to a local instance's. One set of instances serves
every test of the module (starting three takes minutes); the test that kills B runs last.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.conftest import start_server

pytestmark = pytest.mark.slow

SECRET = "scheduler-test-secret"
PROMPTS = [f"Count from {k} to {k + 5}:" for k in range(48)]
MAX_TOKENS = 6
#: Long requests: still running seconds after they start, on any machine.
LONG = {"max_tokens": 200, "ignore_eos": True}
#: Few slots per instance, so A leaves most of a burst queued in Redis for B and C to take.
SMALL = ("--max-num-seqs", "2", "--max-model-len", "256", "--num-gpu-blocks-override", "128")
#: The default keep-alive (ms); the thread writing it keeps a slow instance alive.
EXPIRE_MS = 3000
#: A loaded machine (other jobs on its two cores) makes every request slow; none may time out.
HTTP_TIMEOUT = 300


def global_flags(redis_server, *extra):
    return (*SMALL, "--scheduler-name", "global", "--scheduler-port", str(redis_server.port),
            "--scheduler-secret", SECRET, "--scheduler-min-load-score", "1",
            "--scheduler-expire-period", str(EXPIRE_MS), *extra)


def complete(server, prompt, stream=False, **extra):
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream, **extra}
    with httpx.Client(timeout=HTTP_TIMEOUT) as http:
        if not stream:
            r = http.post(f"{server.url}/v1/completions", json=body, headers=server.headers())
            return r.status_code, r.json()
        events = []
        with http.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers()) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        return r.status_code, events


def metric(server, name):
    return server.metrics()[f"fastdeploy:{name}"]


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


def scheduler_instance(server):
    """The name the server's engine core uses in Redis (``host.pid.random``)."""
    info = httpx.get(f"{server.url}/config-info", headers=server.headers(), timeout=30).json()
    return f".{info['engine_core_pid']}."


def texts_of_stream(events):
    text, usage, errors = "", None, []
    for data in events:
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            errors.append(chunk["error"])
            continue
        for choice in chunk.get("choices", []):
            text += choice.get("text") or ""
        usage = chunk.get("usage") or usage
    return text, usage, errors


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tests.scheduler.conftest import _start

    tmp = tmp_path_factory.mktemp("cluster")
    redis_server = _start(tmp)
    servers = []
    try:
        for _ in range(3):
            servers.append(start_server(str(tmp), *global_flags(redis_server)))
        yield redis_server, servers
    finally:
        for srv in servers:
            srv.stop()
        redis_server.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same requests on one local instance."""
    srv = start_server(str(tmp_path_factory.mktemp("local")), *SMALL)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda p: complete(srv, p), PROMPTS))
        assert all(code == 200 for code, _ in results)
        yield {p: body["choices"][0]["text"] for p, (_, body) in zip(PROMPTS, results)}
    finally:
        srv.stop()


def refused(results):
    """The bodies of the non-200 answers, for an assertion message that says which error it was."""
    return [(k, code, body) for k, (code, body) in enumerate(results) if code != 200]


def test_idle_instances_serve_a_share_token_identical(cluster, reference):
    _, (a, b, c) = cluster
    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        results = list(pool.map(lambda p: complete(a, p), PROMPTS))
    assert refused(results) == []
    for prompt, (_, body) in zip(PROMPTS, results):
        assert body["choices"][0]["text"] == reference[prompt], prompt
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
    ma, mb, mc = a.metrics(), b.metrics(), c.metrics()
    stolen_b = mb["fastdeploy:scheduler_requests_stolen_total"]
    stolen_c = mc["fastdeploy:scheduler_requests_stolen_total"]
    assert stolen_b > 0 and stolen_c > 0, (stolen_b, stolen_c)
    assert mb["fastdeploy:scheduler_requests_served_for_peers_total"] == stolen_b
    assert mc["fastdeploy:scheduler_requests_served_for_peers_total"] == stolen_c
    assert ma["fastdeploy:scheduler_requests_sent_to_peers_total"] == stolen_b + stolen_c
    assert ma["fastdeploy:scheduler_requests_stolen_total"] == 0
    assert_all_freed(a, b, c)


def assert_all_freed(*servers):
    names = ("gpu_cache_usage_perc", "num_requests_running", "scheduler_queue_depth")
    last: list[list[float]] = []

    def freed():
        last[:] = [[srv.metrics()[f"fastdeploy:{name}"] for name in names] for srv in servers]
        return all(values == [0.0, 0, 0] for values in last)

    try:
        wait_for(freed, 30, "every KV block freed, nothing running or queued on any instance")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen per instance {names}: {last}") from None


def test_streaming_and_n_and_logprobs_through_stolen_requests(cluster, reference):
    _, (a, b, c) = cluster
    before = metric(b, "scheduler_requests_stolen_total") + metric(c, "scheduler_requests_stolen_total")
    prompts = PROMPTS[:12]

    def run(p):
        code, events = complete(a, p, stream=True, stream_options={"include_usage": True})
        return code, texts_of_stream(events)

    def run_n(p):
        return complete(a, p, n=2, logprobs=2)

    with concurrent.futures.ThreadPoolExecutor(18) as pool:
        streams = pool.map(run, prompts)
        multi = pool.map(run_n, PROMPTS[12:18])
        streams, multi = list(streams), list(multi)
    for prompt, (code, (text, usage, errors)) in zip(prompts, streams):
        assert (code, errors) == (200, [])
        assert text == reference[prompt]
        assert usage["completion_tokens"] == MAX_TOKENS
        assert usage["prompt_tokens"] > 0
    assert refused(multi) == []
    for prompt, (_, body) in zip(PROMPTS[12:18], multi):
        assert [ch["text"] for ch in body["choices"]] == [reference[prompt]] * 2
        for ch in body["choices"]:
            assert len(ch["logprobs"]["tokens"]) == MAX_TOKENS
            assert all(len(top) == 2 for top in ch["logprobs"]["top_logprobs"])
    after = metric(b, "scheduler_requests_stolen_total") + metric(c, "scheduler_requests_stolen_total")
    assert after > before


def test_a_queue_emptied_by_thieves_while_its_owner_is_busy_reads_empty_after(cluster):
    """A runs two long requests (both its slots) while B and C steal and finish the short ones
    queued behind them, all before A's own finish: A's /metrics must then say its queue is empty
    and count what it sent to peers, not keep the depth and counts of its last busy step."""
    _, (a, b, c) = cluster
    sent = metric(a, "scheduler_requests_sent_to_peers_total")
    stolen = [metric(srv, "scheduler_requests_stolen_total") for srv in (b, c)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        # B and C paused (well within their keep-alive) while A takes its two long requests:
        # otherwise a thief may take one of them between A's queueing and A's own pop.
        for srv in (b, c):
            os.killpg(srv.proc.pid, signal.SIGSTOP)
        try:
            longs = [pool.submit(complete, a, p, **LONG) for p in PROMPTS[:2]]
            wait_for(lambda: metric(a, "num_requests_running") == 2, 30, "A runs its two long requests")
        finally:
            for srv in (b, c):
                os.killpg(srv.proc.pid, signal.SIGCONT)
        shorts = list(pool.map(lambda p: complete(a, p), PROMPTS[2:8]))
        assert refused(shorts) == []
        assert not all(f.done() for f in longs)  # the shorts finished while A was still busy
        assert refused([f.result(timeout=HTTP_TIMEOUT) for f in longs]) == []
    assert_all_freed(a, b, c)
    stolen_now = sum(metric(srv, "scheduler_requests_stolen_total") for srv in (b, c)) - sum(stolen)
    assert stolen_now == 6
    assert metric(a, "scheduler_requests_sent_to_peers_total") - sent == stolen_now


def test_client_disconnect_on_a_stolen_request_frees_it_on_the_thief(cluster):
    """Clients of A hang up while B runs two of their requests: B stops them (it never finishes
    them: its served-for-peers count stays) and frees their blocks."""
    _, (a, b, c) = cluster
    served_b = metric(b, "scheduler_requests_served_for_peers_total")
    served_c = metric(c, "scheduler_requests_served_for_peers_total")
    hang_up = threading.Event()
    chunks = []

    def stream(p):
        body = {"prompt": p, "temperature": 0, "stream": True, **LONG}
        with httpx.Client(timeout=HTTP_TIMEOUT) as http, \
                http.stream("POST", f"{a.url}/v1/completions", json=body, headers=a.headers()) as r:
            for line in r.iter_lines():
                chunks.append(line)
                if hang_up.is_set():
                    return r.status_code  # leaving the block closes the connection
        return r.status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream, p) for p in PROMPTS[:8]]
        try:
            wait_for(lambda: metric(b, "num_requests_running") == 2, 120, "B runs two of A's requests")
        finally:
            hang_up.set()
        codes = [f.result(timeout=HTTP_TIMEOUT) for f in futures]
    assert codes == [200] * 8 and chunks
    wait_for(lambda: metric(b, "num_requests_running") == 0, 30, "B stops the requests whose clients left")
    assert_all_freed(a, b, c)
    assert metric(b, "scheduler_requests_served_for_peers_total") == served_b
    assert metric(c, "scheduler_requests_served_for_peers_total") == served_c


def health(server):
    r = httpx.get(f"{server.url}/health", timeout=30)
    return r.status_code, r.json()


def test_redis_stopped_and_restarted(cluster):
    redis_server, (a, b, c) = cluster

    def stream(p):
        return complete(a, p, stream=True, **LONG)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, p) for p in PROMPTS[:6]]
        wait_for(lambda: metric(a, "num_requests_running") > 0, 120, "A runs the streams")
        redis_server.stop()
        results = [f.result(timeout=60) for f in futures]
    for code, events in results:
        assert code == 200
        _, _, errors = texts_of_stream(events)
        assert errors and errors[0]["code"] == "scheduler_unavailable", events[-3:]
        assert "Redis at 127.0.0.1:" in errors[0]["message"]
    code, body = complete(a, "Hello")
    assert code == 503 and body["error"]["code"] == "scheduler_unavailable"
    assert f"127.0.0.1:{redis_server.port}" in body["error"]["message"]
    # /health says so too, with the same reason, on every instance (B and C notice by themselves).
    for srv in (a, b, c):
        wait_for(lambda srv=srv: health(srv)[0] == 503, 30, "/health answers 503 while Redis is down")
        code, body = health(srv)
        assert body["error"]["code"] == "scheduler_unavailable"
        assert f"127.0.0.1:{redis_server.port}" in body["error"]["message"]
    redis_server.start()
    for srv in (a, b, c):  # every instance recovers by itself
        wait_for(lambda srv=srv: health(srv) == (200, {"status": "ok"}), 30, "/health answers 200 again")
        code, body = complete(srv, PROMPTS[1])
        assert code == 200, body


def test_sigkill_of_a_thief_fails_its_stolen_requests_not_hangs(cluster):
    """B (API process and engine core) is killed while it runs two of A's requests: their clients
    get 503 scheduler_peer_lost within the keep-alive period plus a few seconds; A's other
    requests finish; A and C keep serving; B leaves the load set. Runs last: B stays dead."""
    redis_server, (a, b, c) = cluster
    name_b = scheduler_instance(b)
    load = redis_server.client()
    done_at: dict[int, float] = {}

    def run(k):
        result = complete(a, PROMPTS[k], **LONG)
        done_at[k] = time.monotonic()
        return result

    def b_left():
        members = [m.decode() for m in load.zrange("fastdeploy.default.load.0", 0, -1)]
        return len(members) == 2 and not any(name_b in m for m in members)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(run, k) for k in range(8)]
        wait_for(lambda: metric(b, "num_requests_running") == 2, 120, "B runs two of A's requests")
        assert not b_left()
        os.killpg(b.proc.pid, signal.SIGKILL)  # the whole instance: API process and engine core
        killed = time.monotonic()
        # While A and C still run the rest, B's keep-alive lapses and it leaves the load set.
        wait_for(b_left, EXPIRE_MS / 1000 + 5, "B leaves the load set")
        results = [f.result(timeout=HTTP_TIMEOUT) for f in futures]
    b.proc.wait(10)
    lost = [(k, body) for k, (code, body) in enumerate(results) if code != 200]
    assert len(lost) == 2, refused(results)
    for k, body in lost:
        assert body["error"]["code"] == "scheduler_peer_lost", body
        assert done_at[k] - killed < EXPIRE_MS / 1000 + 5, done_at[k] - killed
    for code, body in results:
        if code == 200:
            assert body["usage"]["completion_tokens"] == LONG["max_tokens"]
    for srv in (a, c):  # A and C keep serving
        code, body = complete(srv, PROMPTS[0])
        assert code == 200, body
    assert b_left()
