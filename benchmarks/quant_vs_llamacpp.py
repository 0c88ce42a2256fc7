"""Batch-1 decode of our float32 / wint8 / wint4 beside llama.cpp on the same GGUF, one run.

Usage: .venv/bin/python benchmarks/quant_vs_llamacpp.py [--threads 1,2] [--tokens 64] [--rounds 3]
       [--json benchmarks/results/quant_vs_llamacpp.json]

For each thread count: llama.cpp's native ``llama-server`` (benchmarks/.peers/llamacpp-native,
``-t N -np 1``) on the Q4_1 GGUF and on a Q8_0 copy (``make_q8_0_gguf.py``), greedy
``/completion`` of the SmolLM2 chat prompt for ``--tokens`` tokens, its own
``timings.predicted_per_second`` (best of ``--rounds``); then ``quant_decode.py`` (ours: the
same prompt, float32 / ``wint8`` / ``wint4``, best round) with ``OMP_NUM_THREADS`` and the
kernel pool at N threads. One process at a time, so they do not share the cores. Not part of
the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from run_stamp import run_stamp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
SERVER = os.path.join(HERE, ".peers", "llamacpp-native", "llama-server")
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llamacpp(model: str, threads: int, tokens: int, rounds: int) -> float:
    port = _port()
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(SERVER))
    cmd = [SERVER, "-m", model, "-t", str(threads), "-tb", str(threads), "-np", "1", "-c", "1024",
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        best = 0.0
        body = {"prompt": PROMPT, "n_predict": tokens, "temperature": 0, "cache_prompt": False, "ignore_eos": True}
        for _ in range(rounds + 1):  # the first is a warm-up
            timings = httpx.post(url + "/completion", json=body, timeout=300).json()["timings"]
            best = max(best, float(timings["predicted_per_second"]))
        return best
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def ours(threads: int, tokens: int, rounds: int, methods: str = "none,wint8,wint4") -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), FD_CPU_KERNEL_THREADS=str(threads))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ours.json")
        cmd = [sys.executable, os.path.join(HERE, "quant_decode.py"), "--methods", methods,
               "--tokens", str(tokens), "--rounds", str(rounds), "--json", out]  # fmt: skip
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as fh:
            return json.load(fh)["methods"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--methods", default="none,wint8,wint4", help="ours (quant_decode.py names, e.g. add wint4:fma)"
    )
    args = parser.parse_args()
    from fastdeploy_core.default_model import default_model_path

    q4 = default_model_path()
    q8 = os.path.join(HERE, ".peers", "smollm2-q8_0.gguf")
    if not os.path.exists(q8):
        subprocess.run([sys.executable, os.path.join(HERE, "make_q8_0_gguf.py"), q4, q8], check=True)
    stamp = run_stamp()
    record = {
        **stamp,
        "machine": f"{stamp['cpus']} vCPU {stamp['cpu_model']} ({platform.machine()})",
        "load_before": os.getloadavg(),
        "runs": [],
    }
    rows = ["| threads | llama.cpp Q4_1 | llama.cpp Q8_0 | ours float32 | ours wint8 | ours wint4 | wint8 / float32 | wint4 / llama.cpp Q4_1 |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for threads in (int(t) for t in args.threads.split(",")):
        peer_q4 = llamacpp(q4, threads, args.tokens, args.rounds)
        peer_q8 = llamacpp(q8, threads, args.tokens, args.rounds)
        mine = ours(threads, args.tokens, args.rounds, args.methods)
        speed = {m: r["decode_tok_s"] for m, r in mine.items()}
        run = {"threads": threads, "llamacpp_q4_1": peer_q4, "llamacpp_q8_0": peer_q8, "ours": speed,
               "load": os.getloadavg()}  # fmt: skip
        record["runs"].append(run)
        f32, w8, w4 = speed["none"], speed["wint8"], speed["wint4"]
        rows.append(f"| {threads} | {peer_q4:.1f} | {peer_q8:.1f} | {f32:.1f} | {w8:.1f} | {w4:.1f} | "
                    f"{w8 / f32:.2f}x | {w4 / peer_q4:.2f}x |")  # fmt: skip
        print(rows[-1], file=sys.stderr, flush=True)
        for extra in sorted(set(speed) - {"none", "wint8", "wint4"}):
            print(f"  threads {threads}: ours {extra} {speed[extra]:.1f} tok/s", file=sys.stderr, flush=True)
    record["load_after"] = os.getloadavg()
    print(f"{record['date']}, {record['machine']}, load {record['load_before'][0]:.1f} -> {record['load_after'][0]:.1f}")
    print("\n".join(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=1)


if __name__ == "__main__":
    main()
