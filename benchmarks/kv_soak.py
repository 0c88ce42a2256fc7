"""Does the engine's memory stop growing under load? A bounded soak of ``fastdeploy serve``.

Starts ``fastdeploy serve`` with its defaults (the default model, the device's default KV
budget), then keeps --clients concurrent clients sending /v1/completions for --duration
seconds, each prompt different (random words, 150-600 tokens, 32-128 tokens out), so prefix
caching cannot absorb them and the cache fills with new blocks until the budget is used. Every
--interval seconds it samples the resident memory (RSS) of the engine-core process and the API
process. At the end it stops the server with SIGTERM and records its exit status.

The claim it checks: engine RSS stays under weights + KV budget + OVERHEAD_BYTES, and levels off
(its growth over the last third of the run is small against the budget). The KV budget and the
activation estimate are read from /config-info. The stated overhead covers what is neither
weights nor KV: Paddle's runtime and kernel library, the tokenizer, one step's activations (the
engine's own estimate, also reported) and the captured decode steps' arenas.

    .venv/bin/python benchmarks/kv_soak.py [--clients 64] [--duration 600] [--interval 5] [--kv-cache-memory 1GiB]

``--kv-cache-memory`` is passed to the server: the ceiling is the same whatever the budget, but
the default budget (25% of available RAM, ~5 GB on a 24 GB host) takes longer than 10 minutes
to fill on two vCPUs (about 5 MiB/s of new KV there), so a run meant to show the plateau within
10 minutes gives a smaller one.

Writes benchmarks/results/kv_soak.json (stamped with date and CPU) and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import psutil
from local_server import free_port
from run_stamp import run_stamp

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
#: What the engine process may hold besides weights and KV cache (see the module docstring).
OVERHEAD_BYTES = 1024 * MiB
#: "Levelled off": RSS growth over the last third of the run below this share of the KV budget.
LEVEL_SHARE = 0.02

MODEL_NAME = ["default"]  # replaced by the served model name read from /config-info
WORDS = [
    "river",
    "stone",
    "light",
    "paper",
    "window",
    "garden",
    "engine",
    "market",
    "silver",
    "winter",
    "orange",
    "signal",
    "harbor",
    "forest",
    "copper",
    "lantern",
    "meadow",
    "valley",
    "thunder",
    "pocket",
    "ladder",
    "island",
    "mirror",
    "candle",
    "rocket",
    "planet",
    "violin",
    "marble",
    "canyon",
    "feather",
    "bridge",
    "compass",
    "velvet",
    "glacier",
    "whistle",
]


def engine_process(server: psutil.Process) -> psutil.Process:
    """The engine core: the server's child process holding the most memory (the others, if
    any, are multiprocessing's resource tracker)."""
    children = server.children(recursive=True)
    if not children:
        raise RuntimeError("the server has no child process; is the engine core running in it?")
    return max(children, key=lambda p: p.memory_info().rss)


async def client(http: httpx.AsyncClient, seed: int, stop_at: float, counts: dict) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(150, 600)))
        body = {"model": MODEL_NAME[0], "prompt": prompt, "max_tokens": rng.randint(32, 128), "temperature": 0.8}
        try:
            r = await http.post("/v1/completions", json=body, timeout=600)
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
        except httpx.HTTPError as exc:
            counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1


async def sample(engine: psutil.Process, api: psutil.Process, start: float, stop_at: float, interval: float, out: list):
    while time.monotonic() < stop_at:
        out.append(
            {
                "t_s": round(time.monotonic() - start, 1),
                "engine_rss_mib": round(engine.memory_info().rss / MiB, 1),
                "api_rss_mib": round(api.memory_info().rss / MiB, 1),
            }
        )
        print(f"  t={out[-1]['t_s']:6.1f}s engine RSS {out[-1]['engine_rss_mib']:8.1f} MiB", flush=True)
        await asyncio.sleep(interval)


async def load(base: str, clients: int, duration: float, interval: float, engine, api) -> tuple[list, dict]:
    samples: list = []
    counts: dict = {}
    start = time.monotonic()
    stop_at = start + duration
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base, limits=limits) as http:
        await asyncio.gather(
            sample(engine, api, start, stop_at, interval, samples),
            *(client(http, seed, stop_at, counts) for seed in range(clients)),
        )
    return samples, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--kv-cache-memory", default=None, help="passed to fastdeploy serve (default: its rule)")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "kv_soak.json"))
    args = parser.parse_args()

    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "fastdeploy")
    cmd = [exe, "serve", "--host", "127.0.0.1", "--port", str(port)]
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", args.kv_cache_memory]
    log_path = os.path.join(HERE, "results", "kv_soak_server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)  # the child keeps its own copy
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}; see {log_path}")
            time.sleep(0.5)
        info = httpx.get(f"{base}/config-info", timeout=10).json()
        engine_info = info["engine"]
        MODEL_NAME[0] = info["served_model_name"]
        server = psutil.Process(proc.pid)
        pid = info.get("engine_core_pid")
        engine = psutil.Process(pid) if pid else engine_process(server)
        idle_rss = engine.memory_info().rss
        print(f"engine pid {engine.pid}, idle RSS {idle_rss / MiB:.0f} MiB; KV: {engine_info.get('kv_cache_rule')}")
        samples, counts = asyncio.run(load(base, args.clients, args.duration, args.interval, engine, server))
        stats = httpx.get(f"{base}/metrics", timeout=10).text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            exit_status = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_status = proc.wait()

    weights = int(engine_info.get("weight_bytes") or 0)
    kv = int(engine_info["kv_cache_bytes"])
    bound = weights + kv + OVERHEAD_BYTES
    rss = [s["engine_rss_mib"] * MiB for s in samples]
    last_third = [s["engine_rss_mib"] * MiB for s in samples if s["t_s"] >= args.duration * 2 / 3]
    growth_last_third = (last_third[-1] - last_third[0]) if len(last_third) > 1 else 0.0
    last_2min = [s["engine_rss_mib"] * MiB for s in samples if s["t_s"] >= args.duration - 120]
    growth_last_2min = (last_2min[-1] - last_2min[0]) if len(last_2min) > 1 else 0.0
    cache_line = next((ln for ln in stats.splitlines() if ln.startswith("fastdeploy:gpu_cache_usage_perc")), "")
    result = {
        **run_stamp(),
        "command": " ".join(["fastdeploy", "serve", *cmd[6:]]) + " (otherwise defaults, default model)",
        "clients": args.clients,
        "duration_s": args.duration,
        "interval_s": args.interval,
        "kv_cache_rule": engine_info.get("kv_cache_rule"),
        "kv_cache_mib": round(kv / MiB, 1),
        "num_kv_blocks": engine_info.get("num_gpu_blocks"),
        "weights_mib": round(weights / MiB, 1),
        "activation_estimate_mib": round(int(engine_info.get("activation_bytes") or 0) / MiB, 1),
        "stated_overhead_mib": OVERHEAD_BYTES // MiB,
        "bound_mib": round(bound / MiB, 1),
        "engine_rss_idle_mib": round(idle_rss / MiB, 1),
        "engine_rss_max_mib": round(max(rss) / MiB, 1),
        "engine_rss_final_mib": round(rss[-1] / MiB, 1),
        "engine_rss_growth_last_third_mib": round(growth_last_third / MiB, 1),
        "engine_rss_growth_last_2min_mib": round(growth_last_2min / MiB, 1),
        "under_bound": max(rss) <= bound,
        "levelled_off": growth_last_third <= LEVEL_SHARE * kv,
        "responses": {str(k): v for k, v in sorted(counts.items(), key=lambda kv_: str(kv_[0]))},
        "cache_usage_at_end": cache_line,
        "server_exit_status_after_sigterm": exit_status,
        "samples": samples,
    }
    with open(args.output, "w") as fh:
        json.dump(result, fh, indent=1)
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
