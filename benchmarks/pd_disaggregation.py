"""Prefill/decode disaggregation against mixed serving through the router, and the KV transports' speed.

Three serving phases, one after the other on 127.0.0.1 (default model, float32), each with its
own ``fastdeploy router`` and instances, each sent the same ``--concurrency`` streaming requests
at once (``--prompt-tokens`` random token ids each, ``--max-tokens`` output tokens, greedy,
``ignore_eos``):

* ``mixed``: a router in front of one mixed instance;
* ``pd_tcp`` and ``pd_shm``: a ``--splitwise`` router, one prefill and one decode instance, the
  KV cache moved over that transport.

Per phase: TTFT and TPOT (p50 / p90 over the requests) and the KV bytes the decode instance took.
On a 2-core machine the prefill and decode instances share the cores a mixed instance has to
itself, so PD is not expected to win here; this records what it costs.

Then the transports alone, in this process: the KV blocks of ``--prompt-tokens`` tokens of the
default model's cache layout gathered from a cache, carried (``tcp``: a ZMQ frame over a loopback
TCP connection; ``shm``: a ``/dev/shm`` file) and scattered into another cache, against one plain
memcpy of the same bytes (``numpy.copyto``), best of ``--repeats``.

    .venv/bin/python benchmarks/pd_disaggregation.py [--concurrency 16 --prompt-tokens 1024 --max-tokens 32]

Writes ``benchmarks/results/pd_disaggregation.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx
from local_server import free_port, wait_healthy
from run_stamp import run_stamp

HERE = os.path.dirname(os.path.abspath(__file__))
SECRET = "pd-disaggregation-benchmark"


def start(args: list[str], log_path: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="2", FD_API_KEY="", FD_ROUTER_SECRET="")
    with open(log_path, "w") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_registered(router_port: int, timeout: float = 120, **counts: int) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            now = httpx.get(f"http://127.0.0.1:{router_port}/registered_number", timeout=2).json()
            if all(now.get(k) == v for k, v in counts.items()):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"router never had {counts}")


def one_request(base: str, prompt: list[int], max_tokens: int, out: list) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    times = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                if any(c.get("text") for c in chunk.get("choices", [])):
                    times.append(time.perf_counter() - t0)
    out.append({"ttft": times[0], "tpot": (times[-1] - times[0]) / max(1, len(times) - 1), "chunks": len(times)})


def burst(base: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    results: list[dict] = []
    threads = [threading.Thread(target=one_request, args=(base, p, max_tokens, results)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(results) != len(prompts):
        raise RuntimeError(f"{len(prompts) - len(results)} requests failed")
    return results


def percentiles(values: list[float]) -> dict[str, float]:
    s = sorted(values)
    return {"p50_ms": round(statistics.median(s) * 1000, 1), "p90_ms": round(s[int(len(s) * 0.9) - 1] * 1000, 1)}


def kv_bytes(port: int, protocol: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    pattern = rf'fastdeploy:kv_transfer_bytes_total{{direction="received",protocol="{protocol}"}} (\S+)'
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


def serving_phase(name: str, tmp: str, opts, prompts: list[list[int]], warm: list[list[int]]) -> dict:
    exe = [sys.executable, "-m", "fastdeploy_core.cli"]
    router_port = free_port()
    sizing = ["--max-model-len", str(opts.prompt_tokens + opts.max_tokens + 64), "--max-num-seqs",
              str(opts.concurrency), "--num-gpu-blocks-override", str(opts.blocks)]
    router_args = [*exe, "router", "--host", "127.0.0.1", "--port", str(router_port), "--router-secret", SECRET]
    common = ["--host", "127.0.0.1", "--router", f"127.0.0.1:{router_port}", "--router-secret", SECRET, *sizing]
    procs = []
    try:
        if name == "mixed":
            procs.append(start(router_args, os.path.join(tmp, f"{name}-router.log")))
            port = free_port()
            procs.append(start([*exe, "serve", "--port", str(port), *common], os.path.join(tmp, f"{name}.log")))
            wait_healthy(port, procs[-1], timeout=600)
            wait_registered(router_port, mixed=1)
            decode_port, protocol = None, None
        else:
            protocol = name.removeprefix("pd_")
            procs.append(start([*router_args, "--splitwise"], os.path.join(tmp, f"{name}-router.log")))
            prefill_port, decode_port, pd_port = free_port(), free_port(), free_port()
            procs.append(start([*exe, "serve", "--port", str(prefill_port), *common, "--splitwise-role", "prefill",
                                "--pd-comm-port", str(pd_port), "--cache-transfer-protocol", protocol],
                               os.path.join(tmp, f"{name}-prefill.log")))
            procs.append(start([*exe, "serve", "--port", str(decode_port), *common, "--splitwise-role", "decode",
                                "--cache-transfer-protocol", protocol], os.path.join(tmp, f"{name}-decode.log")))
            wait_healthy(prefill_port, procs[1], timeout=600)
            wait_healthy(decode_port, procs[2], timeout=600)
            wait_registered(router_port, prefill=1, decode=1)
        base = f"http://127.0.0.1:{router_port}"
        burst(base, warm, 4)  # first steps compile / capture; their prompts are not the measured ones
        load = os.getloadavg()
        started = time.perf_counter()
        results = burst(base, prompts, opts.max_tokens)
        wall = time.perf_counter() - started
        moved = kv_bytes(decode_port, protocol) if decode_port else 0.0
    finally:
        stop(procs)
    return {
        "ttft": percentiles([r["ttft"] for r in results]),
        "tpot": percentiles([r["tpot"] for r in results]),
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(sum(r["chunks"] for r in results) / wall, 1),
        "kv_bytes_received_by_decode": int(moved),
        "load_average_at_start": [round(x, 2) for x in load],
    }


def transport_bench(prompt_tokens: int, repeats: int) -> dict:
    """Gather -> carry -> scatter of ``prompt_tokens`` tokens' blocks, per transport, beside memcpy."""
    import numpy as np
    import zmq

    sys.path.insert(0, os.path.dirname(HERE))
    from fastdeploy_core.builtin.cpu.kv_transport import ShmKVTransport, TcpKVTransport
    from fastdeploy_core.devices.kv_transport import block_nbytes

    layers, kv_heads, head_dim, block = 30, 3, 64, 16  # SmolLM2-135M's cache, 16-token blocks
    n = -(-prompt_tokens // block)
    blocks = 2 * n + 8
    rng = np.random.default_rng(0)
    src = [tuple(rng.standard_normal((blocks, block, kv_heads, head_dim), dtype=np.float32) for _ in range(2))
           for _ in range(layers)]
    dst = [tuple(np.zeros_like(t) for t in layer) for layer in src]
    local, remote = list(range(0, 2 * n, 2)), list(range(1, 2 * n + 1, 2))
    nbytes = n * block_nbytes(src)
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    out: dict[str, dict] = {}
    for transport_cls in (TcpKVTransport, ShmKVTransport):
        sender, receiver = transport_cls(), transport_cls()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            buffer, handle = sender.buffer(nbytes, "bench")
            sender.gather(src, local, buffer)
            description, frames = sender.send(buffer, handle)
            del buffer
            push.send_multipart([b"x", *frames], copy=False)
            got = pull.recv_multipart(copy=False)[1:]
            data = receiver.receive(description, [f.buffer for f in got])
            receiver.scatter(dst, remote, data)
            del data
            receiver.release(description)
            best = min(best, time.perf_counter() - t0)
        assert all(np.array_equal(d[remote], s[local]) for ls, ld in zip(src, dst) for s, d in zip(ls, ld))
        sender.close()
        receiver.close()
        out[transport_cls.name] = {"seconds": round(best, 4), "gb_per_s": round(nbytes / best / 1e9, 2)}
    flat_src, flat_dst = np.empty(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    flat_src[:] = 1
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(flat_dst, flat_src)
        best = min(best, time.perf_counter() - t0)
    out["memcpy"] = {"seconds": round(best, 4), "gb_per_s": round(nbytes / best / 1e9, 2)}
    push.close(0)
    pull.close(0)
    return {"bytes": nbytes, "blocks": n, **out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=320, help="KV blocks (of 64 tokens) per instance")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--phases", default="mixed,pd_tcp,pd_shm")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "pd_disaggregation.json"))
    opts = parser.parse_args()

    tmp = os.path.join("/tmp", f"pd_disaggregation_{os.getpid()}")
    os.makedirs(tmp, exist_ok=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(opts.prompt_tokens)] for _ in range(opts.concurrency)]
    warm = [[rng.randrange(1000, 40000) for _ in range(64)] for _ in range(2)]
    load_before = os.getloadavg()
    phases = {}
    for name in opts.phases.split(","):
        phases[name] = serving_phase(name, tmp, opts, prompts, warm)
        print(name, phases[name], flush=True)
    transports = transport_bench(opts.prompt_tokens, opts.repeats)
    result = {
        **run_stamp(),
        "what": "PD (router --splitwise, 1 prefill + 1 decode instance) against one mixed instance behind the "
                "router, same concurrent streaming requests; and the KV transports alone against memcpy",
        "model": "default (SmolLM2-135M-Instruct, float32)",
        "concurrency": opts.concurrency,
        "prompt_tokens": opts.prompt_tokens,
        "max_tokens": opts.max_tokens,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "serving": phases,
        "transports": transports,
        "notes": "2 cores shared by every process of a phase: the PD phases run two engines on the cores one mixed "
                 "engine has alone. The prefill instance sends each layer's KV blocks as its forward writes them.",
    }
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    with open(opts.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    print(f"PD vs mixed, {result['date']}, {result['cpu_model']}, load {result['load_average_before']}")
    print("| phase | TTFT p50 / p90 ms | TPOT p50 / p90 ms | output tok/s | KV bytes to decode |")
    print("|---|---|---|---|---|")
    for name, r in phases.items():
        print(f"| {name} | {r['ttft']['p50_ms']} / {r['ttft']['p90_ms']} | {r['tpot']['p50_ms']} / "
              f"{r['tpot']['p90_ms']} | {r['output_tokens_per_s']} | {r['kv_bytes_received_by_decode']} |")
    print(f"transports, {transports['bytes'] / 1e6:.1f} MB ({transports['blocks']} blocks):",
          {k: v for k, v in transports.items() if isinstance(v, dict)})


if __name__ == "__main__":
    main()
