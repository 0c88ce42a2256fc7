"""The cpu device's linear kernels for int8 weights against bfloat16 and float32, by rows per call.

Usage: python benchmarks/int8_linear_kernels.py [--rows 1,16,64,512] [--json benchmarks/results/X.json]

For the default model's MLP shapes ([M, 576] x [576, 1536] and [M, 1536] x [1536, 576]) times,
per call (wall clock, best of 5 rounds of 10 calls, OMP_NUM_THREADS / FD_CPU_KERNEL_THREADS 2):

* ``wint8 int``: ``fd_w8a8_linear`` with two pieces, what ``wint8`` layers run where the CPU has
  integer dot products (int8 quads, each activation row rounded to 16 bits held as two int8 pieces);
* ``wint8 float``: ``fd_int8_linear`` over column tiles, the weights widened to float32 (what
  ``wint8`` ran before, and runs with ``FD_WINT8_INT_DOT=0``);
* ``w8a8 int``: ``fd_w8a8_linear`` with one piece (``--quantization w8a8``);
* ``bf16``: ``fd_bf16_linear`` (``--dtype bfloat16``); ``f32``: ``fd_f32_linear`` (the default).

The weights stay cache-resident (one copy per kernel): this measures the compute of a step with
many rows, not the weight streaming of batch 1. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("FD_CPU_KERNEL_THREADS", os.environ["OMP_NUM_THREADS"])

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def best_time(fn, calls: int = 10, rounds: int = 5) -> float:
    fn()
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,512")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import numpy as np
    import paddle

    from fastdeploy_core.builtin.cpu import layout
    from fastdeploy_core.builtin.cpu.kernels import load_kernels, matrix_paths
    from run_stamp import run_stamp

    k = load_kernels()
    assert k is not None, "kernels did not build"
    rng = np.random.default_rng(0)
    stamp = {**run_stamp(), "kernel_paths": matrix_paths()}
    print(f"# {stamp['cpu_model']}, {stamp['cpus']} cpus, features {', '.join(stamp['matrix_features'])}; "
          f"microseconds per call (GFLOP/s)")
    rows = []
    for K, N in [(576, 1536), (1536, 576)]:
        wf = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
        q = rng.integers(-127, 128, (K, N)).astype(np.int8)
        quads = layout.pack_int8_quad_tiles(paddle.to_tensor(q))
        columns = layout.pack_column_tiles(paddle.to_tensor(q))
        scale = paddle.to_tensor(np.full((1, N), 0.01, np.float32))
        bf16 = layout.pack_bf16_pair_tiles(paddle.to_tensor(wf).astype("bfloat16"))
        f32 = layout.pack_column_tiles(paddle.to_tensor(wf))
        for M in (int(r) for r in args.rows.split(",")):
            x = paddle.randn([M, K])
            kernels = {
                "wint8 int": lambda: k.fd_w8a8_linear(x, quads, scale, 2, 0),
                "wint8 float": lambda: k.fd_int8_linear(x, columns, scale, K, False),
                "w8a8 int": lambda: k.fd_w8a8_linear(x, quads, scale, 1, 0),
                "bf16": lambda: k.fd_bf16_linear(x, bf16, 0),
                "f32": lambda: k.fd_f32_linear(x, f32),
            }
            us = {name: best_time(fn) * 1e6 for name, fn in kernels.items()}
            flop = 2 * M * K * N
            rows.append({"K": K, "N": N, "M": M, "us": {n: round(v, 1) for n, v in us.items()},
                         "gflops": {n: round(flop / v / 1e3, 1) for n, v in us.items()}})
            print(f"[{M}, {K}] x [{K}, {N}]: " + " | ".join(f"{n} {v:.1f} ({flop / v / 1e3:.0f})" for n, v in us.items()),
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**stamp, "what": __doc__.split("\n\n")[1], "rows": rows}, f, indent=1)
        print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
