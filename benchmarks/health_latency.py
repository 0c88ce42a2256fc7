"""How fast ``/health`` answers while the engine core runs a long prefill.

Starts ``fastdeploy serve`` (default model) on 127.0.0.1, measures /health latency while idle,
then sends long prompts (one prefill chunk of --prompt-tokens tokens each) and polls /health
every 20 ms until they finish. Writes benchmarks/results/health_latency.json and prints a table.

    .venv/bin/python benchmarks/health_latency.py [--prompt-tokens 2000] [--requests 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx
from local_server import free_port
from run_stamp import run_stamp

HERE = os.path.dirname(os.path.abspath(__file__))


def summarize(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "count": len(s),
        "p50_ms": round(statistics.median(s) * 1000, 2),
        "p99_ms": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1000, 2),
        "max_ms": round(s[-1] * 1000, 2),
    }


def poll(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=5) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = client.get(url)
            out.append(time.perf_counter() - t0)
            assert r.status_code == 200
            time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=3)
    args = parser.parse_args()

    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "fastdeploy")
    cmd = [exe, "serve", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
           "--max-num-batched-tokens", "4096", "--num-gpu-blocks-override", "512"]
    log = open(os.path.join(HERE, "results", "health_latency_server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="2"))
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        idle: list[float] = []
        stop = threading.Event()
        t = threading.Thread(target=poll, args=(f"{base}/health", stop, idle))
        t.start()
        time.sleep(3)
        stop.set()
        t.join()

        # token ids 1000..: a prompt of exactly --prompt-tokens tokens, different per request (no cache hits)
        busy: list[float] = []
        stop = threading.Event()
        t = threading.Thread(target=poll, args=(f"{base}/health", stop, busy))
        t.start()
        t0 = time.perf_counter()
        durations = []
        for i in range(args.requests):
            prompt = [1000 + ((i * 7919 + k) % 40000) for k in range(args.prompt_tokens)]
            s = time.perf_counter()
            r = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=600)
            assert r.status_code == 200, r.text
            durations.append(time.perf_counter() - s)
        stop.set()
        t.join()
        result = {
            **run_stamp(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
            "server": " ".join(cmd[1:]),
            "prompt_tokens": args.prompt_tokens,
            "prefill_seconds_each": [round(d, 2) for d in durations],
            "idle": summarize(idle),
            "during_prefill": summarize(busy),
            "wall_seconds": round(time.perf_counter() - t0, 1),
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    path = os.path.join(HERE, "results", "health_latency.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
