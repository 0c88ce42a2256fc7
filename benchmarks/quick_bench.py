"""Quick regression benchmark of the engine: decode at batch 1 and 16, prefill of 512 tokens.

Run it before and after a change (a few minutes) and compare the two tables:

    .venv/bin/python benchmarks/quick_bench.py            # our engine only
    .venv/bin/python benchmarks/quick_bench.py --hf       # plus HF transformers (fp32) on the same prompts

Default model (SmolLM2-135M, float32), greedy, eos ignored, random prompts from
``fastdeploy_core.cli.bench.random_prompts`` (the same ones ``hf_peer.py`` uses). Every
engine step is timed twice: wall clock and CPU time of the whole process
(``time.process_time``, all threads). On a shared machine the wall clock moves with the other
work, the CPU time much less, so the CPU ms per step is the figure to compare between runs;
with ``OMP_NUM_THREADS=2`` it includes OpenMP workers' spinning, so compare like with like.
``ops/step`` is the number of Paddle ops one step dispatches (from Paddle's profiler),
which is what batch-1 decode cost is made of in eager mode.

Scenarios: ``decode b1`` and ``decode b16`` (32-token prompts, ``--decode-tokens`` steps after
the first token), ``prefill 512`` (one 512-token prompt to its first token). The figures are
medians over the steps of ``--iters`` iterations after one warm-up iteration.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = (("decode b1", 1, 32), ("decode b16", 16, 32), ("prefill 512", 1, 512))


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f}/{five:.1f}"


def count_paddle_ops(fn) -> collections.Counter:
    """Paddle ops (eager kernels) dispatched by ``fn()``, by name, from Paddle's CPU profiler."""
    from paddle import profiler

    with tempfile.TemporaryDirectory() as tmp:
        prof = profiler.Profiler(
            targets=[profiler.ProfilerTarget.CPU], on_trace_ready=profiler.export_chrome_tracing(tmp)
        )
        prof.start()
        fn()
        prof.stop()
        files = glob.glob(os.path.join(tmp, "*.json"))
        with open(files[0], encoding="utf-8") as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ops = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "Operator":
            ops[e["name"].split(" ")[0]] += 1
    return ops


def _summary(name: str, batch: int, steps: list[tuple[float, float]], tokens_per_step: int) -> dict:
    walls = [w for w, _ in steps]
    cpus = [c for _, c in steps]
    wall = statistics.median(walls)
    return {
        "scenario": name,
        "batch": batch,
        "steps": len(steps),
        "wall_ms_per_step": 1000 * wall,
        "cpu_ms_per_step": 1000 * statistics.median(cpus),
        "tok_per_s": tokens_per_step / wall,
        "tok_per_s_cpu": tokens_per_step / statistics.median(cpus),
    }


# ---- our engine --------------------------------------------------------------------------
def run_engine(args) -> list[dict]:
    from fastdeploy_core.cli.bench import random_prompts
    from fastdeploy_core.engine.llm_engine import LLMEngine
    from fastdeploy_core.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(
        model=args.model,
        max_model_len=1024,
        num_gpu_blocks_override=16 * 1024 // 64 + 16,
        enable_prefix_caching=False,
    )
    vocab = engine.core.vocab_size
    results = []
    for name, batch, prompt_len in SCENARIOS:
        if args.only and name not in args.only:
            continue
        decode = name.startswith("decode")
        out_len = args.decode_tokens + 1 if decode else 1
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        steps: list[tuple[float, float]] = []
        ops = None
        for it in range(1 + args.iters):
            for prompt in random_prompts(batch, prompt_len, vocab, seed=it):
                engine.add_request(prompt, params)
            # the first step(s) run the prompts; decode steps are those after every request has a token
            timed = []
            prefilled = False
            while engine.has_unfinished_requests():
                w, c = time.perf_counter(), time.process_time()
                outs = engine.step()
                w, c = time.perf_counter() - w, time.process_time() - c
                if decode and prefilled:
                    timed.append((w, c))
                if not decode:
                    timed.append((w, c))
                prefilled = prefilled or all(o.outputs[0].token_ids for o in outs) and len(outs) == batch
                if decode and prefilled and ops is None and it == 0 and len(timed) == 3:
                    ops = count_paddle_ops(engine.step)
            if it > 0:
                steps.extend(timed if decode else [(sum(w for w, _ in timed), sum(c for _, c in timed))])
        if not decode:
            for prompt in random_prompts(batch, prompt_len, vocab, seed=99):
                engine.add_request(prompt, params)
            ops = count_paddle_ops(lambda: [engine.step() for _ in iter(engine.has_unfinished_requests, False)])
        r = _summary(name, batch, steps, batch if decode else batch * prompt_len)
        r["ops_per_step"] = sum(ops.values()) if ops is not None else None
        r["top_ops"] = dict(ops.most_common(12)) if ops else {}
        results.append(r)
        print(
            f"  fastdeploy {name}: {r['wall_ms_per_step']:.1f} ms/step wall, {r['cpu_ms_per_step']:.1f} CPU, "
            f"{r['ops_per_step']} ops (load {_load()})",
            file=sys.stderr,
            flush=True,
        )
    return results


# ---- HF transformers peer (own process, any interpreter with torch + transformers) -------
def run_hf(args) -> list[dict]:
    """Runs from ``--hf-python`` too: needs torch, transformers (+ gguf, accelerate), not our package."""
    import torch

    # hf_peer imports our (pure-Python) default_model helper: the source tree, not the package, is enough
    sys.path[:0] = [os.path.join(ROOT, "benchmarks"), ROOT]
    from hf_peer import load_model

    with open(args.prompts, encoding="utf-8") as f:
        job = json.load(f)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    model = load_model(job["model"])
    results = []
    with torch.no_grad():
        for name, batch, prompt_len in SCENARIOS:
            if name not in job["prompts"]:
                continue
            decode = name.startswith("decode")
            steps = []
            for it, prompts in enumerate(job["prompts"][name]):
                ids = torch.tensor(prompts)
                w, c = time.perf_counter(), time.process_time()
                out = model(input_ids=ids, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                w, c = time.perf_counter() - w, time.process_time() - c
                timed = [] if decode else [(w, c)]
                past = out.past_key_values
                for _ in range(args.decode_tokens if decode else 0):
                    w, c = time.perf_counter(), time.process_time()
                    out = model(input_ids=token, past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    token = out.logits[:, -1].argmax(-1, keepdim=True)
                    timed.append((time.perf_counter() - w, time.process_time() - c))
                if it > 0:
                    steps.extend(timed)
            r = _summary(name, batch, steps, batch if decode else batch * prompt_len)
            r["ops_per_step"] = None
            results.append(r)
            print(
                f"  hf {name}: {r['wall_ms_per_step']:.1f} ms/step wall, {r['cpu_ms_per_step']:.1f} CPU "
                f"(load {_load()})",
                file=sys.stderr,
                flush=True,
            )
    return results


def _hf_job(args, tmp: str) -> str:
    """The same prompts our engine gets (``random_prompts``, seed = iteration), in a file for the HF child."""
    from fastdeploy_core.cli.bench import random_prompts
    from fastdeploy_core.loader import resolve_model_source

    source = resolve_model_source(args.model)
    vocab = int(source.hf_config["vocab_size"])
    prompts = {
        name: [random_prompts(batch, length, vocab, seed=it) for it in range(1 + args.iters)]
        for name, batch, length in SCENARIOS
        if not args.only or name in args.only
    }
    path = os.path.join(tmp, "hf_job.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"model": source.path, "prompts": prompts}, f)
    return path


def _child(args, stack: str) -> list[dict]:
    python = sys.executable
    cmd = ["--stack", stack, "--iters", str(args.iters), "--decode-tokens", str(args.decode_tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        if stack == "hf":
            python = args.hf_python or sys.executable
            cmd += ["--prompts", _hf_job(args, tmp)]
        else:
            if args.model:
                cmd += ["--model", args.model]
            for o in args.only or ():
                cmd += ["--only", o]
        proc = subprocess.run(
            [python, os.path.abspath(__file__), *cmd], stdout=subprocess.PIPE, text=True, check=True, cwd=ROOT
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_table(ours: list[dict], hf: list[dict] | None) -> None:
    head = "| scenario | tok/s | wall ms/step | CPU ms/step | Paddle ops/step |"
    sep = "|---|---|---|---|---|"
    if hf:
        head += " HF tok/s | HF CPU ms/step | ratio tok/s | ratio CPU |"
        sep += "---|---|---|---|"
    print(head)
    print(sep)
    peer = {r["scenario"]: r for r in hf or []}
    for r in ours:
        line = (
            f"| {r['scenario']} | {r['tok_per_s']:.1f} | {r['wall_ms_per_step']:.1f} | "
            f"{r['cpu_ms_per_step']:.1f} | {r['ops_per_step']} |"
        )
        p = peer.get(r["scenario"])
        if p:
            line += (
                f" {p['tok_per_s']:.1f} | {p['cpu_ms_per_step']:.1f} | {r['tok_per_s'] / p['tok_per_s']:.2f}x | "
                f"{p['cpu_ms_per_step'] / r['cpu_ms_per_step']:.2f}x |"
            )
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the default model)")
    parser.add_argument("--hf", action="store_true", help="also run HF transformers (torch fp32) on the same prompts")
    parser.add_argument("--iters", type=int, default=2, help="timed iterations per scenario (after one warm-up)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="decode steps per iteration")
    parser.add_argument("--only", action="append", help="run only this scenario (repeatable)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--hf-python", default=None, help="interpreter of the HF peer (default: this one)")
    parser.add_argument("--stack", choices=("fastdeploy", "hf"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.stack:
        if args.stack == "fastdeploy":
            sys.path.insert(0, ROOT)
        results = run_engine(args) if args.stack == "fastdeploy" else run_hf(args)
        print(json.dumps(results))
        return
    from run_stamp import run_stamp

    stamp = run_stamp()
    load_before = _load()
    ours = _child(args, "fastdeploy")
    hf = _child(args, "hf") if args.hf else None
    print(
        f"quick_bench {stamp['date']}, {stamp['cpu_model']}, {stamp['cpus']} CPUs, "
        f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, load average (1m/5m) {load_before} before, {_load()} after"
    )
    print_table(ours, hf)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    **stamp,
                    "load_before": load_before,
                    "load_after": _load(),
                    "omp_num_threads": os.environ["OMP_NUM_THREADS"],
                    "fastdeploy": ours,
                    "hf": hf,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
