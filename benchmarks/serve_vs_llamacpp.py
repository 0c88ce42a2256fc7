"""Our server beside llama.cpp's servers on the same GGUF, 2 threads, at 1, 16 and 64 concurrent requests.

One run measures both, one server at a time (they would fight over the 2 cores otherwise), with
the very same locally generated prompts (``fastdeploy bench serve``'s random dataset), greedy,
``max_tokens`` = --output-len. Writes benchmarks/results/serve_vs_llamacpp.{json,png,md}.

The llama.cpp peer is ``llama-cpp-python[server]`` in its own venv::

    python3 -m venv benchmarks/.peers/llamacpp
    CMAKE_ARGS="-DGGML_NATIVE=ON" benchmarks/.peers/llamacpp/bin/pip install "llama-cpp-python[server]"
    .venv/bin/python benchmarks/serve_vs_llamacpp.py

Note (MEASURED.md): ``python -m llama_cpp.server`` serves one request at a time behind a lock;
llama.cpp's native ``llama-server -np N`` batches. When benchmarks/.peers/llamacpp-native/llama-server
exists (built with cmake from the llama.cpp source in the llama-cpp-python sdist, -DLLAMA_CURL=OFF),
it is measured too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from fastdeploy_core.cli.bench_serve import format_summary, make_requests, plot_summaries, run_benchmark
from fastdeploy_core.default_model import default_model_path

LEVELS = {1: 8, 16: 32, 64: 64}  # concurrency -> number of prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready in {timeout} s")


def start_ours(port: int, max_model_len: int, log) -> tuple[subprocess.Popen, str]:
    cmd = [os.path.join(os.path.dirname(sys.executable), "fastdeploy"), "serve", "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", str(max_model_len), "--max-num-seqs", "64"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="2"))
    wait_ready(f"http://127.0.0.1:{port}/health", proc)
    return proc, " ".join(cmd[1:])


def start_llamacpp(port: int, max_model_len: int, log) -> tuple[subprocess.Popen, str]:
    python = os.path.join(HERE, ".peers", "llamacpp", "bin", "python")
    if not os.path.exists(python):
        raise SystemExit(f"llama.cpp peer missing: {python}; see this script's docstring")
    cmd = [python, "-m", "llama_cpp.server", "--model", default_model_path(), "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", "2", "--n_threads_batch", "2", "--n_ctx", str(max_model_len),
           "--model_alias", "SmolLM2-135M-Instruct",
           # by default a new request cuts the running one short; queue them instead
           "--interrupt_requests", "False"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="2"))
    wait_ready(f"http://127.0.0.1:{port}/v1/models", proc)
    return proc, " ".join(cmd[1:])


NATIVE_SERVER = os.path.join(HERE, ".peers", "llamacpp-native", "llama-server")


def start_llamacpp_native(port: int, max_model_len: int, log) -> tuple[subprocess.Popen, str]:
    """llama.cpp's own ``llama-server`` with 64 parallel slots (built from the llama.cpp source
    vendored in the llama-cpp-python sdist: ``cmake --build build --target llama-server``)."""
    slots = 64
    cmd = [NATIVE_SERVER, "-m", default_model_path(), "--host", "127.0.0.1", "--port", str(port), "-t", "2",
           "-tb", "2", "-np", str(slots), "-c", str(256 * slots), "--alias", "SmolLM2-135M-Instruct"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    wait_ready(f"http://127.0.0.1:{port}/health", proc)
    return proc, " ".join(cmd)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-words", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--levels", default="1,16,64")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    max_model_len = 1024
    results_dir = os.path.join(HERE, "results")
    os.makedirs(results_dir, exist_ok=True)
    log = open(os.path.join(results_dir, "serve_vs_llamacpp_servers.log"), "w")
    runs: list[dict] = []
    commands = {}
    servers = [("fastdeploy-core", start_ours), ("llama-cpp-python", start_llamacpp)]
    if os.path.exists(NATIVE_SERVER):
        servers.append(("llama.cpp llama-server -np 64", start_llamacpp_native))
    for name, starter in servers:
        port = free_port()
        proc, commands[name] = starter(port, max_model_len, log)
        try:
            base = f"http://127.0.0.1:{port}"
            # warm-up: one short request (first-call allocations)
            asyncio.run(run_benchmark(base, "openai", None, make_requests("random", 1, 8, 4, 99), 1, float("inf"), None))
            for conc in levels:
                reqs = make_requests("random", LEVELS.get(conc, conc), args.input_words, args.output_len, seed=conc)
                summary = asyncio.run(run_benchmark(base, "openai", None, reqs, conc, float("inf"), None))
                summary.pop("per_request", None)
                summary.update(server=name, concurrency=conc, label=f"{name} c={conc}")
                print(f"\n== {name}, concurrency {conc}, {len(reqs)} prompts ==\n{format_summary(summary)}", flush=True)
                runs.append(summary)
        finally:
            stop(proc)

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, load average at end {os.getloadavg()}",
        "model": default_model_path(),
        "prompts": f"random words, {args.input_words} words in, max_tokens {args.output_len}, greedy",
        "commands": commands,
        "runs": runs,
    }
    with open(os.path.join(results_dir, "serve_vs_llamacpp.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot_summaries([(r["label"], r) for r in runs], os.path.join(results_dir, "serve_vs_llamacpp.png"))
    rows = ["| server | concurrency | prompts | output tok/s | req/s | TTFT median / p99 ms | TPOT median ms | "
            "ITL median ms | E2EL median ms | failed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rows.append(
            f"| {r['server']} | {r['concurrency']} | {r['num_prompts']} | {r['output_throughput']:.1f} | "
            f"{r['request_throughput']:.2f} | {r['ttft_ms']['median']:.0f} / {r['ttft_ms']['p99']:.0f} | "
            f"{r['tpot_ms']['median']:.0f} | {r['itl_ms']['median']:.0f} | {r['e2el_ms']['median']:.0f} | {r['failed']} |"
        )
    with open(os.path.join(results_dir, "serve_vs_llamacpp.md"), "w") as f:
        f.write(f"# fastdeploy-core server vs llama-cpp-python server ({result['date']})\n\n")
        f.write(f"{result['machine']}; {result['prompts']}; one server at a time, same prompts.\n\n")
        f.write("\n".join(rows) + "\n\nCommands:\n\n")
        for name, cmd in commands.items():
            f.write(f"- {name}: `{cmd}`\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
