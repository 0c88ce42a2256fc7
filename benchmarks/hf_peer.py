"""HF transformers (torch CPU, float32) on the same prompts as ``fastdeploy bench latency``.

The peer for benchmarks/engine_bench.md: it loads the same default GGUF through transformers
(dequantized to float32), draws the same random prompts (``fastdeploy_core.cli.bench.random_prompts``
with the same seeds: iteration ``i`` uses ``seed + i``, warm-up iterations first) and splits
each iteration the same way: prefill = the batched prompt forward that yields the first token,
decode = the remaining ``output_len - 1`` greedy steps with the KV cache (the loop
``generate`` runs, without its logits-processor overhead).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/hf_peer.py --batch-size 1 --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_model(model_path: str | None):
    import torch
    from transformers import AutoModelForCausalLM

    from fastdeploy_core.default_model import default_model_path

    path = model_path or default_model_path()
    if path.endswith(".gguf"):
        folder, name = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def measure(model, prompts: list[list[int]], output_len: int) -> dict:
    import torch

    ids = torch.tensor(prompts)
    with torch.no_grad():
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        first = time.perf_counter()
        for _ in range(output_len - 1):
            out = model(input_ids=token, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        end = time.perf_counter()
    batch, input_len = ids.shape
    return {
        "latency_s": end - start,
        "prefill_s": first - start,
        "decode_s": end - first,
        "prefill_tok_s": batch * input_len / (first - start),
        "decode_tok_s": batch * (output_len - 1) / (end - first),
    }


def main() -> None:
    import torch

    from fastdeploy_core.cli.bench import machine_load, random_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded default model)")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, action="append", help="repeatable; default 1 and 16")
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    t0 = time.perf_counter()
    model = load_model(args.model)
    vocab = model.config.vocab_size
    from run_stamp import run_stamp

    results = {
        **run_stamp(),
        "load_s": time.perf_counter() - t0,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "runs": [],
    }
    for batch in args.batch_size or [1, 16]:
        runs = []
        for i in range(args.num_iters_warmup + args.num_iters):
            prompts = random_prompts(batch, args.input_len, vocab, seed=args.seed + i)
            r = measure(model, prompts, args.output_len)
            if i >= args.num_iters_warmup:
                runs.append(r)
        summary = {
            "batch_size": batch,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "avg_latency": statistics.mean(r["latency_s"] for r in runs),
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        }
        summary["machine"] = machine_load()
        results["runs"].append(summary)
        print(
            f"HF transformers batch {batch}: avg latency {summary['avg_latency']:.3f} s; "
            f"prefill {summary['prefill_tok_s']:.1f} tok/s; decode {summary['decode_tok_s']:.1f} tok/s",
            flush=True,
        )
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
