"""The int4 linear kernel over one decode step's worth of layer weights: old layout vs VNNI layout.

Usage: python benchmarks/int4_step_kernels.py [--rows 1,2,4,8] [--group 32] [--rounds 7] [--json PATH]

Builds the default model's 120 projection weights (30 layers x qkv 576x960, o 576x576,
gate_up 576x3072, down 1536x576; ~80 MB of int4 codes, scales and offsets with groups of 32,
more than the L3 cache, so every call streams its weights from memory as a decode step does)
in both layouts of ``fd_int4_linear``: ``[N / 32, K / 2, 32]`` (float FMA loop) and the VNNI
layout ``[N / 32, K / 8, 32, 4]`` (``vpdpbusd``), the latter with scales and offsets ``[G, N]``,
``[N / 32, G, 32]`` float32 and ``[N / 32, G, 32]`` float16 (GB/s counts float32 scale bytes). Times the 120 calls in sequence, layouts
interleaved round by round in one process, best round reported (ms per step and the weight
bytes read per second). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--act-int8", action="store_true", help="w4a8 (int8 activations) instead of wint4")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")

    import numpy as np
    import paddle

    from fastdeploy_core.builtin.cpu.layout import pack_column_tiles, pack_int4_vnni_tiles
    from fastdeploy_core.builtin.cpu.kernels import load_kernels
    from fastdeploy_core.quantization.codes import quantize_int4

    assert load_kernels() is not None
    from paddle import _C_ops

    run = _C_ops._run_custom_op  # as the cpu ops table calls it
    rng = np.random.default_rng(0)
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    layouts = {"old": [], "vnni": [], "vnni+tiled scales": [], "vnni+tiled fp16 scales": []}
    nbytes = 0
    for _ in range(args.layers):
        for K, N in shapes:
            q = quantize_int4(rng.standard_normal((K, N)).astype(np.float32) / np.sqrt(K), args.group, True)
            w, s, o = (paddle.to_tensor(q[n]) for n in ("weight", "weight_scale", "weight_offset"))
            layouts["old"].append((pack_column_tiles(w), s, o))
            layouts["vnni"].append((pack_int4_vnni_tiles(w), s, o))
            layouts["vnni+tiled scales"].append((layouts["vnni"][-1][0], pack_column_tiles(s), pack_column_tiles(o)))
            layouts["vnni+tiled fp16 scales"].append(
                (layouts["vnni"][-1][0], pack_column_tiles(s.astype("float16")), pack_column_tiles(o.astype("float16")))
            )
            nbytes += K * N // 2 + 2 * 4 * s.shape[0] * N
    xs = {
        M: {K: paddle.to_tensor(rng.standard_normal((M, K)).astype(np.float32)) for K in (576, 1536)}
        for M in (int(r) for r in args.rows.split(","))
    }
    threads = os.environ.get("FD_CPU_KERNEL_THREADS") or os.environ["OMP_NUM_THREADS"]
    print(
        f"threads={threads} group={args.group} act_int8={args.act_int8} weights {nbytes / 1e6:.1f} MB/step, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    from run_stamp import run_stamp

    results = {
        **run_stamp(),
        "threads": threads,
        "group": args.group,
        "act_int8": args.act_int8,
        "weight_mb": nbytes / 1e6,
        "load_before": os.getloadavg()[0],
        "rows": {},
    }
    for M, per_k in xs.items():
        best = {name: float("inf") for name in layouts}
        for _ in range(args.rounds):
            for name, weights in layouts.items():
                t = time.perf_counter()
                for w, s, o in weights:
                    run("fd_int4_linear", per_k[_k_of(w)], w, s, o, args.group, args.act_int8)
                best[name] = min(best[name], time.perf_counter() - t)
        row = {
            name: {"ms_per_step": v * 1e3, "us_per_call": v * 1e6 / len(layouts[name]), "gb_s": nbytes / v / 1e9}
            for name, v in best.items()
        }
        row["speedup"] = best["old"] / min(v for n, v in best.items() if n != "old")
        results["rows"][M] = row
        print(
            f"M={M}: "
            + "  ".join(
                f"{n} {r['ms_per_step']:.2f} ms ({r['us_per_call']:.1f} us/call, {r['gb_s']:.1f} GB/s)"
                for n, r in row.items()
                if n != "speedup"
            )
            + f"  speedup {row['speedup']:.2f}x"
        )
    results["load_after"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


def _k_of(w) -> int:
    return int(w.shape[1]) * (8 if w.ndim == 4 else 2)


if __name__ == "__main__":
    main()
