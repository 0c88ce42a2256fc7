"""Decode speed of the native Llama model alone (no engine, no sampling): batch-1 tok/s.

Usage: python benchmarks/model_forward_speed.py [--model PATH] [--tokens 64] [--batch 1]
       [--threads 2] [--profile]

Prefills the SmolLM2 chat prompt (default model), then runs ``--tokens`` greedy decode steps
over a paged KV cache built by hand (the same ForwardMeta the model runner produces), and
prints prefill time and decode tokens per second. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS (default: 2)")
    parser.add_argument("--repeat", type=int, default=3, help="decode runs; the best is reported")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one decode run")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads or os.environ.get("OMP_NUM_THREADS") or 2)

    import numpy as np
    import paddle

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [root, os.path.join(root, "plugins", "fd-llama")]
    from fd_llama.llama import LlamaForCausalLM

    from fastdeploy_core.loader import load_model_weights, resolve_model_source
    from fastdeploy_core.tokenizer import load_tokenizer
    from fastdeploy_core.testing.paged_harness import build_meta

    t0 = time.perf_counter()
    source = resolve_model_source(args.model)
    model = LlamaForCausalLM(source.hf_config)
    model.eval()
    load_model_weights(model, source)
    tokenizer = load_tokenizer(source)
    load_s = time.perf_counter() - t0
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    )
    num_layers, kv_heads, head_dim = model.kv_cache_spec()
    bs = args.block_size
    blocks_per_seq = -(-(len(prompt) + args.tokens + 1) // bs)
    num_blocks = blocks_per_seq * args.batch
    caches = [
        (paddle.zeros([num_blocks, bs, kv_heads, head_dim]), paddle.zeros([num_blocks, bs, kv_heads, head_dim]))
        for _ in range(num_layers)
    ]
    tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(args.batch)]

    def step(chunks):
        meta = build_meta(chunks, bs)
        hidden = model(meta, caches)
        logits = model.compute_logits(paddle.index_select(hidden, meta.logits_indices, axis=0))
        return paddle.argmax(logits, axis=-1).numpy()

    def run():
        t = time.perf_counter()
        tokens = step([(prompt, 0, tables[b]) for b in range(args.batch)])
        prefill = time.perf_counter() - t
        t, cpu = time.perf_counter(), time.process_time()
        for i in range(args.tokens):
            tokens = step([([int(tokens[b])], len(prompt) + i, tables[b]) for b in range(args.batch)])
        return prefill, time.perf_counter() - t, time.process_time() - cpu

    with paddle.no_grad():
        run()  # warm-up
        results = [run() for _ in range(args.repeat)]
        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            run()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    prefill = min(r[0] for r in results)
    decode = min(r[1] for r in results)
    # CPU seconds of all threads: on a busy shared machine wall time mostly measures waiting;
    # with --threads 1, CPU time per step is the speed the code reaches on an idle core.
    cpu = min(r[2] for r in results)
    print(
        f"model={os.path.basename(source.path)} threads={os.environ['OMP_NUM_THREADS']} batch={args.batch} "
        f"load={load_s:.1f}s prefill({len(prompt)} tok)={prefill * 1e3:.0f}ms "
        f"decode={args.tokens * args.batch / decode:.1f} tok/s ({decode / args.tokens * 1e3:.1f} ms/step, "
        f"cpu {cpu / args.tokens * 1e3:.1f} ms/step)"
    )
    if np.isnan(decode):
        sys.exit(1)


if __name__ == "__main__":
    main()
