"""The PaddleFormers fallback beside the native Llama on the default model (SmolLM2-135M GGUF).

Builds one engine per implementation in this process and runs ``fastdeploy bench latency``'s
measurement (same random prompts, same split of prefill and decode) at each batch size,
alternating the implementations round by round so machine noise hits both alike. Prints a
markdown table and writes benchmarks/results/paddleformers_fallback.json.

    OMP_NUM_THREADS=2 .venv-pfmin/bin/python benchmarks/paddleformers_fallback.py [--rounds 3]

Needs PaddleFormers installed (plugins/fd-paddleformers/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
IMPLS = ("fastdeploy", "paddleformers")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import paddle

    from fastdeploy_core.cli.bench import measure_iteration, random_prompts
    from fastdeploy_core.config import EngineArgs
    from fastdeploy_core.engine.llm_engine import LLMEngine

    engines = {}
    for impl in IMPLS:
        t0 = time.perf_counter()
        engines[impl] = LLMEngine(
            EngineArgs.create(model=None, model_impl=impl, max_model_len=512, max_num_seqs=16, num_gpu_blocks_override=160)
        )
        print(f"{impl}: {type(engines[impl].core.runner.model).__name__} built in {time.perf_counter() - t0:.1f} s")
    vocab = engines["fastdeploy"].core.vocab_size
    results: dict = {impl: {b: [] for b in args.batch_sizes} for impl in IMPLS}
    for batch in args.batch_sizes:
        for impl in IMPLS:  # warm-up
            measure_iteration(engines[impl], random_prompts(batch, args.input_len, vocab, seed=99), 8)
        for r in range(args.rounds):
            prompts = random_prompts(batch, args.input_len, vocab, seed=r)
            for impl in IMPLS if r % 2 == 0 else reversed(IMPLS):
                results[impl][batch].append(measure_iteration(engines[impl], prompts, args.output_len))

    from run_stamp import run_stamp

    summary = {
        **run_stamp(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}",
        "paddle": paddle.__version__,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rounds": args.rounds,
        "results": {},
    }
    lines = [
        "| batch | native decode tok/s | fallback decode tok/s | fallback / native | native prefill tok/s | fallback prefill tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for batch in args.batch_sizes:
        row = {}
        for impl in IMPLS:
            runs = results[impl][batch]
            row[impl] = {
                "decode_tok_s": statistics.median(x["decode_tok_s"] for x in runs),
                "prefill_tok_s": statistics.median(x["prefill_tok_s"] for x in runs),
                "decode_tok_s_all": [round(x["decode_tok_s"], 2) for x in runs],
            }
        ratio = row["paddleformers"]["decode_tok_s"] / row["fastdeploy"]["decode_tok_s"]
        summary["results"][str(batch)] = dict(row, ratio=ratio)
        lines.append(
            f"| {batch} | {row['fastdeploy']['decode_tok_s']:.1f} | {row['paddleformers']['decode_tok_s']:.1f} | "
            f"{ratio:.2f} | {row['fastdeploy']['prefill_tok_s']:.0f} | {row['paddleformers']['prefill_tok_s']:.0f} |"
        )
    print("\n".join(lines))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "paddleformers_fallback.json"), "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
