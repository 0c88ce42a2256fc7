"""Decode tok/s of a small Qwen3-MoE model: the cpu kernel ``fd_fused_moe`` against the reference op.

Usage: python benchmarks/moe_decode.py [--tokens 32] [--rounds 2] [--batches 1,16] [--layers 4] [--json FILE]
       python benchmarks/moe_decode.py --peers [--layers 8] ...

Default mode, "kernel against reference":

The model (hidden 512, 8 experts of width 512, top-2 renormalised, 4 layers, 8 heads of 64,
vocab 4096) gets random weights from transformers' initialiser and is written as safetensors
to a temporary directory, then served by two in-process engines on the cpu device: "kernel"
(the experts packed by ``CpuOps.prepare_expert_weight``, computed by ``fd_fused_moe``) and
"reference" (plain experts, ``ReferenceOps.fused_moe``: tokens sorted by expert on the host,
two Paddle matmuls per used expert). Everything else (attention, linears, norms) is the same
cpu kernels in both. Each round runs every (batch, variant) once, round-robin so machine noise
hits them alike, with prompts of 16 random tokens and ``--tokens`` greedy tokens each; only
steps in which every request decodes are timed. The best round is reported: wall-clock tok/s,
and process CPU time per decode step (the work per step, which a loaded machine distorts less
than the wall clock), with the load average before and after. MoE models run eager (no
captured decode steps: the router's softmax and top-k are Paddle ops). Not part of the test suite.

``--peers`` mode, "MoE against dense and transformers", on the same config: our engine with the
cpu kernel (as "kernel" above); "dense": a Qwen3 dense model of the same shape whose MLP width is
``num_experts_per_tok x moe_intermediate_size`` (the same active parameters per token, minus the
router's ``hidden x experts`` gate), with the engine's default graph capture (whether its decode
steps were really replayed is recorded: the MoE model always runs eager); and transformers (torch CPU,
float32, ``torch.set_num_threads`` equal to ours) on the same saved MoE and dense weights,
``generate`` greedy with a fixed number of new tokens, decode timed from the first token's logits
to the last. After the rounds, profiled steps of the MoE engine (and the dense one when eager) time every
ops-table method (and the router's ``select_experts``) with a wrapper: CPU time per decode step
in ``fused_moe``, attention, linears, norms and the rest (Python, Paddle glue, sampler, scheduler).
``--json`` replaces only this mode's section of the file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

CONFIG = {
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "tie_word_embeddings": False,
}


def dense_config(config: dict) -> dict:
    """The dense-equivalent Qwen3 config: same attention and shapes, MLP of width top-k x expert width."""
    dense = {k: v for k, v in config.items() if k not in MOE_KEYS}
    dense["intermediate_size"] = config["num_experts_per_tok"] * config["moe_intermediate_size"]
    return dense


MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step")


def write_model(path: str, config: dict, dense: bool = False) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    if dense:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config))
    model.eval().save_pretrained(path, safe_serialization=True)


class OpClock:
    """CPU and wall time spent inside wrapped callables, outermost call only (an op that calls
    another op of the table is counted once, under its own name)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.depth = 0

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            c0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c0
                self.calls[name] = self.calls.get(name, 0) + 1
                self.depth -= 1

        return timed


class Bench:
    """The engines' shared setup: the package on the path, the cpu kernels, the decode loop."""

    def __init__(self, args) -> None:
        import numpy as np

        self.args = args
        self.rng = np.random.default_rng(0)

    def engine(self, path: str, **settings):
        from fastdeploy_core.config import EngineArgs
        from fastdeploy_core.engine.engine_core import EngineCore

        base = {"model": path, "max_model_len": 16 + self.args.tokens + 8, "num_gpu_blocks_override": 512}
        return EngineCore(EngineArgs.create(**base, **settings))

    def prompts(self, batch: int, vocab: int) -> list:
        return self.rng.integers(0, vocab, (batch, 16)).tolist()

    def decode(self, engine, prompts: list, clock: OpClock | None = None) -> dict:
        """Greedy ``--tokens`` for each prompt; wall and CPU time of the steps in which every
        request decodes (and, with a clock, the CPU time its wrapped ops took in those steps)."""
        from fastdeploy_core.engine.outputs import EngineCoreRequest
        from fastdeploy_core.engine.sampling_params import SamplingParams

        greedy = SamplingParams(temperature=0, max_tokens=self.args.tokens, ignore_eos=True)
        batch = len(prompts)
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineCoreRequest(f"b{batch}-{i}-{time.monotonic_ns()}", prompt, greedy))
        started: set[str] = set()
        wall = cpu = 0.0
        steps = 0
        ops: dict[str, float] = {}
        while engine.has_unfinished_requests():
            decoding = len(started) == batch
            before = dict(clock.cpu) if clock else {}
            t0, c0 = time.perf_counter(), time.process_time()
            outs = engine.step()
            if decoding:
                wall += time.perf_counter() - t0
                cpu += time.process_time() - c0
                steps += 1
                for name, total in (clock.cpu if clock else {}).items():
                    ops[name] = ops.get(name, 0.0) + total - before.get(name, 0.0)
            started.update(o.request_id for o in outs if o.new_token_ids)
        return {"wall": wall, "cpu": cpu, "steps": steps, "ops": ops}


def row(batch: int, variant: str, wall: float, cpu: float, steps: int) -> dict:
    return {
        "batch": batch,
        "variant": variant,
        "decode_steps": steps,
        "tok_per_s": round(batch * steps / wall, 1),
        "ms_per_step": round(1000 * wall / steps, 2),
        "cpu_ms_per_step": round(1000 * cpu / steps, 2),
    }


def kernel_against_reference(args, config: dict, batches: list[int]) -> dict:
    from fastdeploy_core.builtin.cpu.ops import CpuOps
    from fastdeploy_core.devices.reference_ops import ReferenceOps

    kernel_moe, kernel_prepare = CpuOps.fused_moe, CpuOps.prepare_expert_weight

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids):
        # The "reference" engine loaded its experts plain (rank 3), the "kernel" engine packed.
        if w13.ndim == 3:
            return ReferenceOps.fused_moe(self, x, w13, w2, topk_weights, topk_ids)
        return kernel_moe(self, x, w13, w2, topk_weights, topk_ids)

    CpuOps.fused_moe = fused_moe
    bench = Bench(args)
    with tempfile.TemporaryDirectory() as path:
        write_model(path, config)
        engines = {}
        for variant in ("reference", "kernel"):
            CpuOps.prepare_expert_weight = kernel_prepare if variant == "kernel" else (lambda self, weight: None)
            engines[variant] = bench.engine(path)
        CpuOps.prepare_expert_weight = kernel_prepare

        load_before = os.getloadavg()
        best: dict[tuple[int, str], dict] = {}
        for _ in range(args.rounds):
            for batch in batches:
                for variant, engine in engines.items():
                    run = bench.decode(engine, bench.prompts(batch, config["vocab_size"]))
                    r = row(batch, variant, run["wall"], run["cpu"], run["steps"])
                    key = (batch, variant)
                    if key not in best or r["tok_per_s"] > best[key]["tok_per_s"]:
                        best[key] = r
        load_after = os.getloadavg()
    CpuOps.fused_moe = kernel_moe

    rows = [best[(b, v)] for b in batches for v in ("reference", "kernel")]
    for b in batches:
        ref, ker = best[(b, "reference")], best[(b, "kernel")]
        ker["speedup_wall"] = round(ker["tok_per_s"] / ref["tok_per_s"], 2)
        ker["speedup_cpu"] = round(ref["cpu_ms_per_step"] / ker["cpu_ms_per_step"], 2)
    return {"load_average_before": load_before, "load_average_after": load_after, "rows": rows}


def transformers_decode(model, prompts: list, tokens: int) -> dict:
    """``generate`` greedy, exactly ``tokens`` new tokens; the decode part is timed from the first
    token's logits (the prompt's forward done) to the last token's, ``tokens - 1`` steps."""
    import torch
    import transformers

    stamps: list[tuple[float, float]] = []

    class Stamp(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append((time.perf_counter(), time.process_time()))
            return scores

    with torch.no_grad():
        model.generate(
            torch.tensor(prompts),
            attention_mask=torch.ones(len(prompts), len(prompts[0]), dtype=torch.long),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            logits_processor=transformers.LogitsProcessorList([Stamp()]),
            pad_token_id=0,
        )
    assert len(stamps) == tokens, f"generate made {len(stamps)} tokens, asked for {tokens}"
    return {"wall": stamps[-1][0] - stamps[0][0], "cpu": stamps[-1][1] - stamps[0][1], "steps": tokens - 1}


#: ops-table methods timed by ``--peers``'s profiled steps, and the group each one reports under
PROFILED_OPS = {
    "fused_moe": "experts (fused_moe)",
    "rope_paged_attention": "attention (rope_paged_attention)",
    "linear": "linears (qkv, o, router gate; dense: the MLP)",
    "greedy_lm_head": "lm head (greedy_lm_head)",
    "argmax_rows": "lm head (greedy_lm_head)",
    "embedding": "norms, embedding, activation",
    "rms_norm": "norms, embedding, activation",
    "add_rms_norm": "norms, embedding, activation",
    "silu_and_mul": "norms, embedding, activation",
}


def peers(args, config: dict, batches: list[int]) -> dict:
    import torch
    import transformers

    import fastdeploy_core.layers.moe as moe_layer
    from fastdeploy_core.builtin.cpu.ops import CpuOps

    threads = int(os.environ.get("FD_CPU_KERNEL_THREADS") or os.environ["OMP_NUM_THREADS"])
    torch.set_num_threads(threads)
    dense = dense_config(config)
    bench = Bench(args)
    with tempfile.TemporaryDirectory() as moe_path, tempfile.TemporaryDirectory() as dense_path:
        write_model(moe_path, config)
        write_model(dense_path, dense, dense=True)
        engines = {
            "fastdeploy moe": bench.engine(moe_path),
            "fastdeploy dense": bench.engine(dense_path),
        }
        hf = {
            "transformers moe": transformers.Qwen3MoeForCausalLM.from_pretrained(moe_path, dtype=torch.float32),
            "transformers dense": transformers.Qwen3ForCausalLM.from_pretrained(dense_path, dtype=torch.float32),
        }
        for model in hf.values():
            model.eval()
        variants = [*engines, *hf]

        load_before = os.getloadavg()
        best: dict[tuple[int, str], dict] = {}
        for _ in range(args.rounds):
            for batch in batches:
                prompts = bench.prompts(batch, config["vocab_size"])
                for variant in variants:
                    if variant in engines:
                        run = bench.decode(engines[variant], prompts)
                    else:
                        run = transformers_decode(hf[variant], prompts, args.tokens)
                    r = row(batch, variant, run["wall"], run["cpu"], run["steps"])
                    key = (batch, variant)
                    if key not in best or r["tok_per_s"] > best[key]["tok_per_s"]:
                        best[key] = r
        load_middle = os.getloadavg()
        graphs = engines["fastdeploy dense"].runner.graphs
        dense_capture = "off" if graphs is None else graphs.disabled_reason or "on (decode steps replayed)"

        clock = OpClock()
        originals = {name: getattr(CpuOps, name) for name in PROFILED_OPS}
        original_select = moe_layer.select_experts
        for name, fn in originals.items():
            setattr(CpuOps, name, clock.wrap(name, fn))
        moe_layer.select_experts = clock.wrap("select_experts", original_select)
        breakdown = []
        # the dense model's steps are profiled too when they run eager (a replayed graph calls no op)
        profiled = ["fastdeploy moe"] + (["fastdeploy dense"] if graphs is None or graphs.disabled_reason else [])
        try:
            for batch, variant in [(b, v) for b in batches for v in profiled]:
                run = bench.decode(engines[variant], bench.prompts(batch, config["vocab_size"]), clock)
                groups: dict[str, float] = {}
                for name, cpu in run["ops"].items():
                    group = PROFILED_OPS.get(name, "router softmax + top-k (Paddle ops)")
                    groups[group] = groups.get(group, 0.0) + cpu
                groups["the rest (Python, Paddle glue, sampler, scheduler)"] = run["cpu"] - sum(groups.values())
                step_ms = 1000 * run["cpu"] / run["steps"]
                breakdown.append(
                    {
                        "batch": batch,
                        "variant": variant,
                        "decode_steps": run["steps"],
                        "cpu_ms_per_step": round(step_ms, 2),
                        "cpu_ms_per_step_by_part": {g: round(1000 * c / run["steps"], 2) for g, c in groups.items()},
                    }
                )
        finally:
            for name, fn in originals.items():
                setattr(CpuOps, name, fn)
            moe_layer.select_experts = original_select
        load_after = os.getloadavg()

    rows = [best[(b, v)] for b in batches for v in variants]
    for b in batches:
        ours = best[(b, "fastdeploy moe")]
        for v in variants:
            best[(b, v)]["moe_engine_vs_this_wall"] = round(ours["tok_per_s"] / best[(b, v)]["tok_per_s"], 2)
            best[(b, v)]["moe_engine_vs_this_cpu"] = round(best[(b, v)]["cpu_ms_per_step"] / ours["cpu_ms_per_step"], 2)
    return {
        "dense_config": dense,
        "dense_graph_capture": dense_capture,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after_timed_rounds": load_middle,
        "load_average_after": load_after,
        "rows": rows,
        "step_cpu_breakdown": breakdown,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 4, with --peers 8)")
    parser.add_argument("--peers", action="store_true", help="MoE against its dense equivalent and transformers")
    parser.add_argument("--json", default=None, help="also write the results to this file (this mode's section)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [root, os.path.join(os.path.dirname(os.path.abspath(__file__)))]

    from run_stamp import run_stamp

    from fastdeploy_core.builtin.cpu.kernels import load_kernels

    assert load_kernels() is not None, "the cpu kernels must build for this benchmark"
    config = dict(CONFIG, num_hidden_layers=args.layers or (8 if args.peers else 4))
    batches = [int(b) for b in args.batches.split(",")]
    measure = peers if args.peers else kernel_against_reference
    section = "moe_vs_dense_vs_transformers" if args.peers else "kernel_vs_reference"
    found = measure(args, config, batches)
    for key in [k for k in found if k.startswith("load_average")]:
        found[key] = [round(v, 2) for v in found[key]]
    result = {
        **run_stamp(),
        "config": config,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "threads": os.environ.get("FD_CPU_KERNEL_THREADS") or os.environ.get("OMP_NUM_THREADS"),
        **found,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        sections = {}
        if os.path.exists(args.json):
            with open(args.json) as fh:
                sections = json.load(fh)
            if "rows" in sections:  # a file from before the modes: the kernel-against-reference run
                sections = {"kernel_vs_reference": sections}
        sections[section] = result
        with open(args.json, "w") as fh:
            json.dump(sections, fh, indent=1)


if __name__ == "__main__":
    main()
