"""Speculative decoding through the server at batch 16: output tok/s, TTFT and TPOT of
``fastdeploy bench serve`` (16 concurrent streams, greedy, eos ignored) against one
``fastdeploy serve`` (default model, float32, 2 threads) per setting, in one run:
speculation off, ``ngram`` and a wint4 self-draft (``draft_model``).

The prompts are ``bench serve``'s random word lists, which give ngram little to look up; the
self-draft guesses from the model itself. The server's own speculation counters
(``/metrics``) are recorded beside each run. Writes ``benchmarks/results/spec_decode_serve.json``.

    .venv/bin/python benchmarks/spec_decode_serve.py [--num-prompts 32] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile

import httpx
from local_server import fastdeploy, free_port, wait_healthy
from run_stamp import run_stamp

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = {
    "off": None,
    "ngram_k4": {"method": "ngram", "num_speculative_tokens": 4},
    "self_draft_wint4_k4": {"method": "draft_model", "num_speculative_tokens": 4, "quantization": "wint4"},
}
COUNTERS = ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
            "spec_decode_num_emitted_tokens_total")


def metrics(port: int) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("fastdeploy:spec_decode_"):
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0].removeprefix("fastdeploy:")] = float(value)
    return values


def run_setting(name: str, spec: dict | None, opts: argparse.Namespace, workdir: str) -> dict:
    port = free_port()
    cmd = [*fastdeploy(), "serve", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024",
           "--max-num-seqs", str(opts.concurrency)]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    env = dict(os.environ, OMP_NUM_THREADS="2", FD_API_KEY="")
    with open(os.path.join(workdir, f"{name}.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(port, proc)
        out = os.path.join(workdir, f"{name}.json")
        subprocess.run([*fastdeploy(), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                        "--num-prompts", str(opts.num_prompts), "--max-concurrency", str(opts.concurrency),
                        "--random-input-len", str(opts.input_len), "--random-output-len", str(opts.output_len),
                        "--result-file", out, "--label", name], check=True, stdout=subprocess.DEVNULL)
        with open(out, encoding="utf-8") as fh:
            summary = json.load(fh)
        counters = metrics(port)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {
        "speculative_config": spec,
        "completed": summary["completed"],
        "failed": summary["failed"],
        "output_tok_s": round(summary["output_throughput"], 1),
        "ttft_p50_ms": round(summary["ttft_ms"]["median"], 1),
        "tpot_p50_ms": round(summary["tpot_ms"]["median"], 1),
        "load_average": [summary["load_before"], summary["load_after"]],
        "server_counters": counters,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "spec_decode_serve.json"))
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="spec_serve_") as workdir:
        results = {name: run_setting(name, spec, opts, workdir) for name, spec in SETTINGS.items()}
    base = results["off"]["output_tok_s"]
    for r in results.values():
        r["output_tok_s_vs_off"] = round(r["output_tok_s"] / base, 2) if base else None
    data = {
        **run_stamp(),
        "what": f"fastdeploy bench serve, {opts.concurrency} concurrent greedy streams, {opts.num_prompts} prompts of "
                f"{opts.input_len} random words, {opts.output_len} tokens each (eos ignored), one server per setting",
        "model": "default (SmolLM2-135M-Instruct, float32), 2 threads",
        "results": results,
    }
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    with open(opts.out, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
    print(f"{data['date']}, {data['cpu_model']}")
    print("| setting | output tok/s | vs off | TTFT p50 ms | TPOT p50 ms | drafts | accepted |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        c = r["server_counters"]
        print(f"| {name} | {r['output_tok_s']} | {r['output_tok_s_vs_off']} | {r['ttft_p50_ms']} | {r['tpot_p50_ms']} | "
              f"{int(c.get('spec_decode_num_draft_tokens_total', 0))} | "
              f"{int(c.get('spec_decode_num_accepted_tokens_total', 0))} |")


if __name__ == "__main__":
    main()
