"""Paged attention of a batch of decode tokens: what one decode step's attention costs.

Usage: python benchmarks/decode_attention.py [--seqs 64] [--contexts 64,112,500]
       [--cache-dtypes bfloat16,float32] [--rounds 20] [--json out.json]

``fd_paged_attention`` over ``--seqs`` sequences of one new token each, at SmolLM2-135M's shape
(9 query heads, 3 kv heads, head size 64, blocks of 64 tokens), one cache per layer for 30 layers
(as the engine holds them, so the rows come from DRAM, not from a cache level that one layer's
rows would fit in); the sequences' blocks are scattered over the cache. Reported: the median
time of the 30 layers over ``--rounds`` rounds and the bytes of keys and values read per second.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--contexts", default="64,112,500")
    parser.add_argument("--cache-dtypes", default="bfloat16,float32")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        parser.error(f"--contexts takes comma-separated key counts, not {args.contexts!r}")
    bad = [t for t in args.cache_dtypes.split(",") if t not in ("bfloat16", "float32")]
    if bad:
        parser.error(f"--cache-dtypes takes bfloat16 and/or float32, not {', '.join(bad)}")
    if args.seqs < 1 or args.rounds < 1 or min(contexts) < 0:
        parser.error("--seqs and --rounds must be at least 1, --contexts at least 0")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_module import kernels_or_exit

    kernels = kernels_or_exit()

    import numpy as np
    import paddle

    from fastdeploy_core.testing.batches import BlockPool, blocks_for, build_meta
    from attention_layers import BLOCK, HEAD_DIM, HEADS, KV_HEADS, LAYERS, layer_caches, median_over_layers
    from run_stamp import run_stamp

    num_blocks = args.seqs * blocks_for(max(contexts) + 1, BLOCK) + 8
    rng = np.random.default_rng(0)
    base = rng.standard_normal((num_blocks, BLOCK, KV_HEADS, HEAD_DIM)).astype(np.float32)
    q = paddle.to_tensor(rng.standard_normal((args.seqs, HEADS, HEAD_DIM)).astype(np.float32))
    results = {"shape": f"{args.seqs} decode tokens, {HEADS} heads, {KV_HEADS} kv heads, head size {HEAD_DIM}, "
               f"{LAYERS} layers each with its own cache", **run_stamp(), "rows": []}
    for dtype in args.cache_dtypes.split(","):
        caches = layer_caches(base, dtype)
        for ctx in contexts:
            pool = BlockPool(num_blocks, seed=1)
            meta = build_meta([([0], ctx, pool.take(blocks_for(ctx + 1, BLOCK))) for _ in range(args.seqs)], BLOCK)
            median = median_over_layers(kernels, q, caches, meta, 0, args.rounds, 2)
            read = args.seqs * (ctx + 1) * KV_HEADS * HEAD_DIM * 2 * (2 if dtype == "bfloat16" else 4) * LAYERS
            row = {"cache": dtype, "keys": ctx + 1, "ms_30_layers": round(1e3 * median, 2),
                   "gb_per_s": round(read / median / 1e9, 1)}
            results["rows"].append(row)
            print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
