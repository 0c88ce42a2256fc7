"""``fd_bf16_linear`` at the shapes of one SmolLM2-135M step: what the linear layers of a step cost.

Usage: python benchmarks/bf16_step_shapes.py [--rows 64] [--path 0] [--layers-apart] [--json out.json]

For ``--rows`` rows (a step's tokens), each projection of a layer (fused QKV [576, 960], output
[576, 576], fused gate/up [576, 3072], down [1536, 576]) and the LM head [576, 49152], with
bfloat16 weights in the kernel's pair tiles on the path the CPU chooses (``--path 0``; 2 forces
``vdpbf16ps``, 3 AMX tiles, 1 widening): best of 15 calls after
3 warm-ups, and the step's total (30 layers and one head). Where the linears take AMX tiles the
gate/up projection is also timed with its SwiGLU in one op (``fd_bf16_linear_silu``) and the
head with its greedy argmax in one (``fd_bf16_linear_argmax``), as the model runs them on
greedy steps; the step total counts those. With ``--layers-apart`` each projection
has 30 distinct weight matrices, as the model's layers do (~212 MB of bfloat16 weights, which no
cache holds: each step reads them from memory), and a call's time is the best of 5 passes over
the 30, divided by 30; without it one matrix is called again and again from the caches.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SHAPES = [("qkv", 576, 960, 30), ("o", 576, 576, 30), ("gate_up", 576, 3072, 30), ("down", 1536, 576, 30),
          ("head", 576, 49152, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--path", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--layers-apart", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.rows < 1:
        parser.error("--rows must be at least 1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_module import kernels_or_exit

    kernels = kernels_or_exit()

    import numpy as np
    import paddle

    from fastdeploy_core.builtin.cpu import layout
    from fastdeploy_core.builtin.cpu.kernels import matrix_paths
    from run_stamp import run_stamp

    rng = np.random.default_rng(0)
    m = args.rows
    result = {**run_stamp(), "kernel_paths": matrix_paths(), "path": args.path, "rows": m,
              "layers_apart": args.layers_apart, "shapes": []}
    total_us = total_macs = 0.0
    from fastdeploy_core.builtin.cpu.kernels import amx_state

    # the gate/up projection with its SwiGLU and the head with its argmax in one op each, as the
    # model runs them on AMX tiles (path 3): rows of their own, in the step total instead
    fused = args.path in (0, 3) and amx_state("fd_bf16_amx_state") == 1
    shapes = SHAPES + ([("gate_up+silu", 576, 3072, 30), ("head+argmax", 576, 49152, 1)] if fused else [])
    for name, k, n, count in shapes:
        copies = count if args.layers_apart else 1
        weights = [layout.pack_bf16_pair_tiles(
            paddle.to_tensor((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)).astype("bfloat16"))
            for _ in range(copies)]
        x = paddle.randn([m, k])
        op = {"gate_up+silu": lambda x, w: kernels.fd_bf16_linear_silu(x, w, 3),
              "head+argmax": lambda x, w: kernels.fd_bf16_linear_argmax(x, w, 3)}.get(
            name, lambda x, w: kernels.fd_bf16_linear(x, w, args.path))
        for _ in range(3):
            op(x, weights[0])
        times = []
        for _ in range(5 if args.layers_apart else 15):
            t0 = time.perf_counter()
            for weight in weights:
                op(x, weight)
            times.append((time.perf_counter() - t0) / copies)
        us = 1e6 * min(times)
        row = {"name": name, "shape": f"[{m}, {k}] x [{k}, {n}]", "us": round(us, 1),
               "gflop_s": round(2 * m * k * n / us / 1e3, 1), "per_step": count}
        result["shapes"].append(row)
        print(json.dumps(row))
    by_name = {row["name"]: row for row in result["shapes"]}
    for name, k, n, count in SHAPES:
        us = by_name[{"gate_up": "gate_up+silu", "head": "head+argmax"}.get(name, name) if fused else name]["us"]
        total_us += us * count
        total_macs += m * k * n * count
    result["step_ms"] = round(total_us / 1e3, 2)
    result["step_gflop_s"] = round(2 * total_macs / total_us / 1e3, 1)
    print(f"step: {result['step_ms']} ms, {result['step_gflop_s']} GFLOP/s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
