"""What the router adds to a request: the same requests sent to an instance directly and
through ``fastdeploy router`` in front of it, alternating, in one run.

Starts ``fastdeploy router`` and one ``fastdeploy serve`` (default model) on 127.0.0.1, the
instance registered with the router, then for ``--rounds`` rounds sends, once directly and once
through the router (order alternating between rounds):

* ``GET /v1/models`` (the proxy path alone, no engine work),
* a non-streaming completion of ``max_tokens=1`` (request to answer),
* a streaming completion of ``max_tokens=16`` (time to the first token, and to the end).

The router's added latency is the median of the per-round differences (router minus direct).
Writes ``benchmarks/results/router_overhead.json`` and prints a table.

    .venv/bin/python benchmarks/router_overhead.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
from local_server import free_port, wait_healthy
from run_stamp import run_stamp

HERE = os.path.dirname(os.path.abspath(__file__))
SECRET = "router-overhead-benchmark"
PROMPT = "The capital of France is"


def start(args: list[str], log_path: str, threads: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=threads, FD_API_KEY="", FD_ROUTER_SECRET="")
    with open(log_path, "w") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} not ready within {timeout:.0f} s")


def timed_models(client: httpx.Client, base: str) -> float:
    t0 = time.perf_counter()
    r = client.get(f"{base}/v1/models")
    r.raise_for_status()
    return time.perf_counter() - t0


def timed_completion(client: httpx.Client, base: str) -> float:
    t0 = time.perf_counter()
    r = client.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0


def timed_stream(client: httpx.Client, base: str) -> tuple[float, float]:
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.perf_counter() - t0
    return first or 0.0, time.perf_counter() - t0


def ms(values: list[float]) -> dict[str, float]:
    s = sorted(values)
    return {"p50_ms": round(statistics.median(s) * 1000, 2), "p90_ms": round(s[int(len(s) * 0.9)] * 1000, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "router_overhead.json"))
    opts = parser.parse_args()

    tmp = os.path.join("/tmp", f"router_overhead_{os.getpid()}")
    os.makedirs(tmp, exist_ok=True)
    router_port, server_port = free_port(), free_port()
    exe = [sys.executable, "-m", "fastdeploy_core.cli"]
    load_before = os.getloadavg()
    router = start([*exe, "router", "--host", "127.0.0.1", "--port", str(router_port), "--policy", "round_robin",
                    "--router-secret", SECRET], os.path.join(tmp, "router.log"), "1")
    server = start([*exe, "serve", "--host", "127.0.0.1", "--port", str(server_port), "--max-model-len", "512",
                    "--max-num-seqs", "4", "--router", f"127.0.0.1:{router_port}", "--router-secret", SECRET],
                   os.path.join(tmp, "server.log"), "2")
    direct, routed = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{router_port}"
    try:
        wait_healthy(server_port, server, timeout=300)
        wait_until(lambda: httpx.get(f"{routed}/registered_number", timeout=2).json().get("mixed") == 1, 60,
                   "registration")
        samples: dict[str, dict[str, list[float]]] = {
            k: {"direct": [], "router": []} for k in ("models", "completion_1_token", "stream_ttft", "stream_16_tokens")
        }
        with httpx.Client(timeout=120) as client:
            for base in (direct, routed):  # warm-up: first requests compile and connect
                timed_completion(client, base)
                timed_stream(client, base)
            for i in range(opts.rounds):
                order = [("direct", direct), ("router", routed)]
                if i % 2:
                    order.reverse()
                for name, base in order:
                    samples["models"][name].append(timed_models(client, base))
                    samples["completion_1_token"][name].append(timed_completion(client, base))
                    ttft, total = timed_stream(client, base)
                    samples["stream_ttft"][name].append(ttft)
                    samples["stream_16_tokens"][name].append(total)
    finally:
        for proc in (server, router):
            proc.send_signal(signal.SIGTERM)
        for proc in (server, router):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    results = {}
    for what, by_path in samples.items():
        added = [r - d for r, d in zip(by_path["router"], by_path["direct"])]
        results[what] = {
            "direct": ms(by_path["direct"]),
            "router": ms(by_path["router"]),
            "added_p50_ms": round(statistics.median(added) * 1000, 2),
        }
    result = {
        **run_stamp(),
        "what": "latency a request gains by going through fastdeploy router (round_robin) to one instance, "
                "against the same instance directly, alternating, sequential requests",
        "model": "default (SmolLM2-135M-Instruct, float32)",
        "rounds": opts.rounds,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "results": results,
    }
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    with open(opts.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    print(f"router overhead, {result['date']}, {result['cpu_model']}, load {result['load_average_before']}")
    print("| request | direct p50 ms | router p50 ms | added p50 ms |")
    print("|---|---|---|---|")
    for what, r in results.items():
        print(f"| {what} | {r['direct']['p50_ms']} | {r['router']['p50_ms']} | {r['added_p50_ms']} |")


if __name__ == "__main__":
    main()
