"""Paged attention of a prompt: what the attention of one prefill step costs, on its own.

Usage: python benchmarks/prompt_attention.py [--lengths 512,2048] [--prompts 1]
       [--cache-dtype bfloat16] [--path 0] [--rounds 7] [--json out.json]

``fd_paged_attention`` for ``--prompts`` prompts of each length computed in one step (every
token a query over the keys before it, causal), at SmolLM2-135M's shape (9 query heads, 3 kv
heads, head size 64, blocks of 64 tokens), one cache per layer for 30 layers; ``--path`` is the
kernel's bf16 path (0 the CPU's best: AMX tiles where granted; 2 vdpbf16ps; 1 widening).
Reported: the median time of the 30 layers over ``--rounds`` rounds, and the score elements
(query rows x visible keys) per second. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--cache-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--path", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    try:
        lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths takes comma-separated token counts, not {args.lengths!r}")
    if args.prompts < 1 or args.rounds < 1 or min(lengths) < 1:
        parser.error("--prompts, --rounds and --lengths must be at least 1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_module import kernels_or_exit

    kernels = kernels_or_exit()

    import numpy as np
    import paddle

    from fastdeploy_core.testing.batches import BlockPool, blocks_for, build_meta
    from attention_layers import BLOCK, HEAD_DIM, HEADS, KV_HEADS, LAYERS, layer_caches, median_over_layers
    from run_stamp import run_stamp

    results = {"shape": f"{args.prompts} prompt(s) per step, {HEADS} heads, {KV_HEADS} kv heads, head size "
               f"{HEAD_DIM}, {LAYERS} layers each with its own cache, {args.cache_dtype} cache, path {args.path}",
               **run_stamp(), "rows": []}
    rng = np.random.default_rng(0)
    for n in lengths:
        num_blocks = args.prompts * blocks_for(n, BLOCK) + 8
        base = rng.standard_normal((num_blocks, BLOCK, KV_HEADS, HEAD_DIM)).astype(np.float32)
        caches = layer_caches(base, args.cache_dtype)
        q = paddle.to_tensor(rng.standard_normal((args.prompts * n, HEADS, HEAD_DIM)).astype(np.float32))
        pool = BlockPool(num_blocks, seed=1)
        meta = build_meta([([0] * n, 0, pool.take(blocks_for(n, BLOCK))) for _ in range(args.prompts)], BLOCK)
        median = median_over_layers(kernels, q, caches, meta, args.path, args.rounds, 1)
        scores = args.prompts * HEADS * n * (n + 1) // 2 * LAYERS
        row = {"tokens": n, "ms_30_layers": round(1e3 * median, 2), "g_scores_per_s": round(scores / median / 1e9, 2)}
        results["rows"].append(row)
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
