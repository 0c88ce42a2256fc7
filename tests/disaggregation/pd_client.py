"""What the prefill/decode serving tests send and read: completions (streamed or not), an
instance's /metrics values, and the wait for every KV block to be free again."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.entrypoints.openai.conftest import API_KEY, start_server
from tests.router.conftest import ROUTER_SECRET, start_router

AUTH = {"Authorization": f"Bearer {API_KEY}"}

_TOPICS = ["a lighthouse keeper's logbook", "the rules of a village chess club", "a bakery's morning routine",
           "the timetable of a mountain railway"]
_PREFIXES = [f"Background ({topic}). " + " ".join(f"Entry {k}: {topic} notes item {k} in order." for k in range(18))
             + " Answer briefly.\n" for topic in _TOPICS]
_QUESTIONS = ["What is the first entry?", "Summarize the background.", "What comes after entry 3?",
              "Give one word for it:"]
_OTHERS = ["Hello", "The capital of France is", "Write a list of three colors:", "2 + 2 =",
           "def fibonacci(n):", "Translate 'good morning' to French:", "The largest planet is",
           "Once upon a time", "List the days of the week:", "The opposite of hot is",
           "A haiku about rain:\n", "Name a prime number greater than ten:",
           "The quick brown fox " * 20, "Count to five: one, two,", "Water boils at",
           "Explain recursion in one sentence:"]
#: 32 prompts: 16 sharing four long prefixes (prefix-cache hits where they are computed), 16 others.
PROMPTS_32 = [p + q for p in _PREFIXES for q in _QUESTIONS] + _OTHERS
#: Per prompt of PROMPTS_32: (prompt, max_tokens, stream, ignore_eos): varied budgets, half of
#: them streamed, every fourth one past EOS (so its answer is not empty).
JOBS_32 = [(p, 4 + (i * 5) % 11, i % 2 == 1, i % 4 == 0) for i, p in enumerate(PROMPTS_32)]


@contextlib.contextmanager
def cluster(tmp: str, router_args: tuple, specs: list[tuple], unrouted: int = 0, **counts: int) -> Iterator:
    """A ``--splitwise`` router (``router_args`` added) with an instance per spec of ``specs``
    registered with it (started at once), plus ``unrouted`` instances it does not know (mixed
    references); yields ``(router, instances)`` once the router counts ``counts`` (role=number),
    and stops everything after."""
    router, servers = None, []
    try:
        router = start_router(tmp, "--splitwise", *router_args)
        common = ("--router", f"127.0.0.1:{router.port}", "--router-secret", ROUTER_SECRET)
        every = [(*spec, *common) for spec in specs] + [()] * unrouted
        with ThreadPoolExecutor(len(every)) as pool:
            servers = list(pool.map(lambda spec: start_server(tmp, *spec), every))
        router.wait_for(timeout=60, **counts)
        yield router, servers
    finally:
        for srv in servers:
            srv.stop()
        if router is not None:
            router.stop()


def complete(base: str, prompt: str, max_tokens: int, stream: bool, **extra) -> str:
    """The text of a greedy completion (a stream's chunks joined); any error fails the test."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}
    if not stream:
        resp = httpx.post(f"{base}/v1/completions", headers=AUTH, json=body, timeout=240)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]
    pieces = []
    with httpx.stream("POST", f"{base}/v1/completions", headers=AUTH, json=body, timeout=240) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                pieces.extend(c["text"] for c in chunk["choices"])
    return "".join(pieces)


def run_job(base: str, job: tuple) -> str:
    """One of JOBS_32."""
    prompt, max_tokens, stream, ignore_eos = job
    return complete(base, prompt, max_tokens, stream, ignore_eos=ignore_eos)


def metric(server, name: str, **labels: str) -> float:
    """The value of ``name`` with ``labels`` in the instance's /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.partition(" ")[0]))
        if line.partition("{")[0].partition(" ")[0] == name and all(found.get(k) == v for k, v in labels.items()):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"{name} {labels} not in {server.url}/metrics")


def all_blocks_free(servers, timeout: float = 15.0) -> None:
    """Wait until every instance's KV blocks are all free again (fail after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        state = [(metric(s, "fastdeploy:free_gpu_block_num"), metric(s, "fastdeploy:max_gpu_block_num"))
                 for s in servers]
        if all(free == total for free, total in state):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held (free, total) per instance: {state}")
        time.sleep(0.2)
