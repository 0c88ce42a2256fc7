"""Quantized-weight linear kernels (cpu C++ ops) against float32 ``paddle.matmul``.

Usage: python benchmarks/quant_kernels.py [--rows 1,4,37] [--repeats 5]

For each shape (the default model's projections and its LM head) and row count, times the
float32 matmul, the int8 / int4 (groups of 32, GGUF Q4-style) / fp8 kernels and the plain-Paddle
reference path of int8. "cold": a rotation of weight copies larger than the L3 cache, so every
call streams its weights from DRAM as a decode step does; "hot": one weight, cache-resident.
All variants run interleaved, best of ``--repeats`` rounds. ``--cpu-time`` measures the calling
thread's CPU time instead of wall time and forces one thread everywhere: the work per call, which a
busy shared machine does not distort. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,37")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--l3-bytes", type=float, default=32e6)
    parser.add_argument("--cpu-time", action="store_true", help="thread CPU time, one thread")
    args = parser.parse_args()
    if args.cpu_time:
        os.environ["OMP_NUM_THREADS"] = os.environ["FD_CPU_KERNEL_THREADS"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    clock = time.thread_time if args.cpu_time else time.perf_counter

    import numpy as np
    import paddle

    from fastdeploy_core.quantization.fp8 import quantize_block_fp8
    from fastdeploy_core.builtin.cpu.kernels import load_kernels
    from fastdeploy_core.quantization.weight_only import int8_linear_reference
    from fastdeploy_core.quantization.codes import quantize_int4, quantize_int8

    k = load_kernels()
    assert k is not None, "kernels did not build"
    rng = np.random.default_rng(0)
    shapes = [(576, 1536), (1536, 576), (576, 960), (576, 49152)]
    what = "thread CPU" if args.cpu_time else "wall"
    print(f"threads={os.environ['OMP_NUM_THREADS']}  {what} microseconds per call (best of {args.repeats})")
    print(
        f"{'K x N':<12}{'M':>4}{'mode':>6}{'fp32':>9}{'int8':>9}{'int4':>9}{'fp8':>9}{'int8 ref':>10}{'int8 x':>8}{'int4 x':>8}"
    )
    for K, N in shapes:
        w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
        q8, q4, f8 = quantize_int8(w, K), quantize_int4(w, 32, True), quantize_block_fp8(w, (128, 128))
        copies = max(1, int(3 * args.l3_bytes // (K * N * 4)))
        fp32 = [paddle.to_tensor(w + i * 1e-3) for i in range(copies)]
        i8 = [(paddle.to_tensor(q8["weight"]), paddle.to_tensor(q8["weight_scale"])) for _ in range(copies)]
        i4 = [
            tuple(paddle.to_tensor(q4[n]) for n in ("weight", "weight_scale", "weight_offset")) for _ in range(copies)
        ]
        e4 = [
            (paddle.to_tensor(f8["weight"]).astype(paddle.float8_e4m3fn), paddle.to_tensor(f8["weight_scale"]))
            for _ in range(copies)
        ]
        for M in (int(r) for r in args.rows.split(",")):
            x = paddle.to_tensor(rng.standard_normal((M, K)).astype(np.float32))
            variants = {  # default arguments bind this iteration's tensors
                "fp32": lambda i, x=x, w=fp32: paddle.matmul(x, w[i]),
                "int8": lambda i, x=x, w=i8, K=K: k.fd_int8_linear(x, *w[i], K, False),
                "int4": lambda i, x=x, w=i4: k.fd_int4_linear(x, *w[i], 32, False),
                "fp8": lambda i, x=x, w=e4: k.fd_fp8_linear(x, *w[i], 128),
                "int8 ref": lambda i, x=x, w=i8, K=K: int8_linear_reference(x, *w[i], K),
            }
            for mode, n_weights in (("cold", copies), ("hot", 1)):
                calls = max(3 * n_weights, 30 if K * N < 2e6 else 6)
                best = {name: float("inf") for name in variants}
                for _ in range(args.repeats):
                    for name, fn in variants.items():
                        fn(0)
                        t = clock()
                        for c in range(calls):
                            fn(c % n_weights)
                        best[name] = min(best[name], (clock() - t) / calls * 1e6)
                print(
                    f"{K}x{N:<7}{M:>4}{mode:>6}"
                    + "".join(f"{best[n]:>9.0f}" for n in ("fp32", "int8", "int4", "fp8"))
                    + f"{best['int8 ref']:>10.0f}{best['fp32'] / best['int8']:>8.2f}{best['fp32'] / best['int4']:>8.2f}"
                )


if __name__ == "__main__":
    main()
