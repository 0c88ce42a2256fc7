"""Prefill/decode disaggregation with real processes on 127.0.0.1: a ``--splitwise`` router, one
prefill instance offering ``shm`` and ``tcp``, and two decode instances, one taking the KV cache
over ``tcp`` (with a small cache: 40 blocks, so long prompts wait for room there) and one over
``shm``. Greedy answers through the pair are the tokens the prefill instance gives when asked
directly (it then computes the whole request itself, as a mixed instance does).
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.disaggregation.pd_client import AUTH, JOBS_32, all_blocks_free, complete, metric, run_job
from tests.disaggregation.pd_client import cluster as pd_cluster
from tests.entrypoints.openai.conftest import API_KEY, free_port

pytestmark = pytest.mark.slow

SHARED = ("You are a careful assistant. The following notes describe a small town by a river, its bridges, "
          "its market on Saturdays, the school, the old mill and the people who keep the gardens. ") * 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    specs = [
        # Prompt steps of at most 128 tokens: a long prompt's blocks go in several batches, chunk by chunk.
        ("--splitwise-role", "prefill", "--pd-comm-port", str(free_port()), "--cache-transfer-protocol", "shm,tcp",
         "--max-num-batched-tokens", "128"),
        ("--splitwise-role", "decode", "--cache-transfer-protocol", "tcp", "--num-gpu-blocks-override", "40"),
        ("--splitwise-role", "decode", "--cache-transfer-protocol", "shm,tcp"),
    ]
    with pd_cluster(str(tmp_path_factory.mktemp("pd")), ("--decode-policy", "round_robin"), specs,
                    prefill=1, decode=2) as running:
        yield running


def test_pd_answers_are_the_mixed_answers_and_every_block_is_freed(cluster):
    """The 32 requests of ``pd_client.JOBS_32`` at once through the router (round robin over the
    two decode instances), against the prefill instance serving the same requests whole."""
    router, (prefill, decode_tcp, decode_shm) = cluster
    jobs = JOBS_32
    with ThreadPoolExecutor(len(jobs)) as pool:
        routed = list(pool.map(lambda job: run_job(router.url, job), jobs))
        reference = list(pool.map(lambda job: run_job(prefill.url, job), jobs))  # served whole there
    assert routed == reference
    assert all(text for text, job in zip(reference, jobs) if job[3])
    # Each decode instance took half the requests, and its transport carried their KV.
    tcp = metric(decode_tcp, "fastdeploy:kv_transfer_bytes_total", protocol="tcp", direction="received")
    shm = metric(decode_shm, "fastdeploy:kv_transfer_bytes_total", protocol="shm", direction="received")
    assert tcp > 0 and shm > 0
    assert metric(decode_shm, "fastdeploy:kv_transfer_bytes_total", protocol="tcp", direction="received") == 0
    assert metric(prefill, "fastdeploy:kv_transfer_bytes_total", protocol="tcp", direction="sent") == tcp
    assert metric(prefill, "fastdeploy:kv_transfer_bytes_total", protocol="shm", direction="sent") == shm
    assert metric(decode_tcp, "fastdeploy:pd_transfers_completed_total") == len(jobs) // 2
    assert metric(decode_shm, "fastdeploy:pd_transfers_completed_total") == len(jobs) // 2
    all_blocks_free([prefill, decode_tcp, decode_shm])


def test_prompts_beyond_the_small_decode_cache_wait_for_room(cluster):
    """Decode instance 1 holds 40 blocks of 16 tokens: one 400-token prompt (25 blocks + output) at
    a time. Four such requests, two per decode instance, all finish with the mixed tokens."""
    router, (prefill, decode_tcp, decode_shm) = cluster
    prompts = [f"Item {i}: " + "the river runs under the old stone bridge near the mill. " * 33 for i in range(4)]
    batches = sum(metric(prefill, "fastdeploy:kv_transfer_batches_total", protocol=p, direction="sent")
                  for p in ("tcp", "shm"))
    with ThreadPoolExecutor(len(prompts)) as pool:
        routed = list(pool.map(lambda p: complete(router.url, p, 8, True), prompts))
    # ~400-token prompts in prompt steps of at most 128 tokens: each one's blocks went in several
    # batches, sent as its chunks completed.
    after = sum(metric(prefill, "fastdeploy:kv_transfer_batches_total", protocol=p, direction="sent")
                for p in ("tcp", "shm"))
    assert after - batches >= 3 * len(prompts)
    reference = [complete(prefill.url, p, 8, False) for p in prompts]
    assert routed == reference
    all_blocks_free([prefill, decode_tcp, decode_shm])


def test_a_request_preempted_on_the_decode_side_is_recomputed_there_with_the_same_tokens(cluster):
    """Two 250-token prompts growing to 400 tokens on the 40-block decode instance (50 blocks of
    16 tokens between them): one is preempted and recomputed from its tokens on the decode side."""
    router, (prefill, decode_tcp, decode_shm) = cluster
    prompts = [f"Note {i}. " + "A lantern hangs by the door of the baker's house. " * 23 for i in range(4)]
    before = metric(decode_tcp, "fastdeploy:num_preemptions_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        routed = list(pool.map(lambda p: complete(router.url, p, 150, False, ignore_eos=True), prompts))
    assert metric(decode_tcp, "fastdeploy:num_preemptions_total") > before
    with ThreadPoolExecutor(len(prompts)) as pool:  # the prefill instance's 512 blocks hold all four
        reference = list(pool.map(lambda p: complete(prefill.url, p, 150, False, ignore_eos=True), prompts))
    assert routed == reference
    all_blocks_free([prefill, decode_tcp, decode_shm])


def test_a_decode_instance_refuses_a_pairing_the_router_did_not_sign(cluster):
    router, (prefill, decode_tcp, _) = cluster
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).encode()
    forged = {**AUTH, "Content-Type": "application/json", "X-FD-Disaggregate": json.dumps({"prefill": "10.0.0.9:1"}),
              "X-FD-Disaggregate-Signature": f"{time.time():.3f}:" + "00" * 32}
    resp = httpx.post(f"{decode_tcp.url}/v1/completions", content=body, headers=forged, timeout=60)
    assert resp.status_code == 403 and "pairing header was refused (bad pairing signature)" in resp.text
    # Without a pairing the decode instance serves the request whole.
    plain = httpx.post(f"{decode_tcp.url}/v1/completions", content=body, timeout=60,
                       headers={**AUTH, "Content-Type": "application/json"})
    assert plain.status_code == 200
    assert plain.json()["choices"][0]["text"] == complete(prefill.url, "The capital of France is", 4, False)


def test_a_client_disconnect_frees_the_request_on_both_sides(cluster):
    router, servers = cluster
    body = {"prompt": SHARED + "Tell a long story:", "max_tokens": 300, "temperature": 0, "stream": True,
            "ignore_eos": True}
    for _ in range(2):  # one per decode instance
        got = []
        with httpx.stream("POST", f"{router.url}/v1/completions", headers=AUTH, json=body, timeout=120) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    got.append(line)
                if len(got) >= 3:
                    break
        assert len(got) == 3 and all("error" not in json.loads(line[6:]) for line in got), got
    all_blocks_free(servers)


def test_a_client_gone_before_the_first_token_drops_the_request_on_the_prefill_side_too(cluster):
    """The client leaves while the prefill instance still computes a 480-token prompt: the decode
    instance aborts, tells the prefill instance, and the prefill instance drops it unfinished."""
    router, (prefill, *decodes) = cluster
    done = metric(prefill, "fastdeploy:pd_transfers_completed_total")
    body = {"prompt": "Seven rivers meet below the hills where the shepherds rest. " * 40, "max_tokens": 4,
            "temperature": 0, "stream": True}
    raw = json.dumps(body).encode()
    client = socket.create_connection(("127.0.0.1", router.port))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
    deadline = time.monotonic() + 30
    while metric(prefill, "fastdeploy:pd_transfers_in_flight") == 0:  # the prefill instance took it
        assert time.monotonic() < deadline, "the prefill instance never took the request"
        time.sleep(0.01)
    client.close()
    # The client is gone; the prefill instance drops the request before it finishes.
    deadline = time.monotonic() + 10
    while metric(prefill, "fastdeploy:pd_transfers_in_flight") != 0:
        assert time.monotonic() < deadline, "the prefill instance kept the request"
        time.sleep(0.05)
    assert metric(prefill, "fastdeploy:pd_transfers_completed_total") == done
    all_blocks_free([prefill, *decodes])


def test_a_decode_instance_killed_mid_stream_ends_the_stream_with_an_error_in_2_s(cluster):
    router, (prefill, decode_tcp, decode_shm) = cluster
    body = {"prompt": "Count from one to one thousand:", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    events: list[tuple[float, str]] = []
    first = threading.Event()

    def reader() -> None:
        with httpx.stream("POST", f"{router.url}/v1/completions", headers=AUTH, json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append((time.monotonic(), line[6:]))
                    first.set()

    before = {s.port: metric(s, "fastdeploy:num_requests_running") for s in (decode_tcp, decode_shm)}
    del before
    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    assert first.wait(60), "no token arrived"
    # The stream's decode instance is the one running a request now.
    running = [s for s in (decode_tcp, decode_shm) if metric(s, "fastdeploy:num_requests_running") > 0]
    assert len(running) == 1
    victim = running[0]
    killed = time.monotonic()
    victim.stop(signal.SIGKILL)
    thread.join(10)
    assert not thread.is_alive()
    last_time, last = events[-1]
    assert "error" in json.loads(last), last
    assert last_time - killed < 2.0
    # The survivor serves the next requests; the prefill instance holds nothing for the dead one.
    survivor = decode_shm if victim is decode_tcp else decode_tcp
    assert complete(router.url, "The capital of France is", 4, False)
    all_blocks_free([prefill, survivor])
