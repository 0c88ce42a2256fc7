"""Decode tok/s of a small Qwen3-MoE model: the cpu kernel ``fd_fused_moe`` against the reference op.

Usage: python benchmarks/moe_decode.py [--tokens 32] [--rounds 2] [--batches 1,16] [--json FILE]

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


def write_model(path: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG)).eval()
    model.save_pretrained(path, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [root, os.path.join(os.path.dirname(os.path.abspath(__file__)))]

    import numpy as np
    from run_stamp import run_stamp

    from fastdeploy_core.builtin.cpu.kernels import load_kernels
    from fastdeploy_core.builtin.cpu.ops import CpuOps
    from fastdeploy_core.config import EngineArgs
    from fastdeploy_core.devices.reference_ops import ReferenceOps
    from fastdeploy_core.engine.engine_core import EngineCore
    from fastdeploy_core.engine.outputs import EngineCoreRequest
    from fastdeploy_core.engine.sampling_params import SamplingParams

    assert load_kernels() is not None, "the cpu kernels must build for this benchmark"
    kernel_moe, kernel_prepare = CpuOps.fused_moe, CpuOps.prepare_expert_weight

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids):
        # The "reference" engine loaded its experts plain (rank 3), the "kernel" engine packed.
        if w13.ndim == 3:
            return ReferenceOps.fused_moe(self, x, w13, w2, topk_weights, topk_ids)
        return kernel_moe(self, x, w13, w2, topk_weights, topk_ids)

    CpuOps.fused_moe = fused_moe
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as path:
        write_model(path)
        engines = {}
        for variant in ("reference", "kernel"):
            CpuOps.prepare_expert_weight = kernel_prepare if variant == "kernel" else (lambda self, weight: None)
            settings = {"model": path, "max_model_len": 16 + args.tokens + 8, "num_gpu_blocks_override": 512}
            engines[variant] = EngineCore(EngineArgs.create(**settings))
        CpuOps.prepare_expert_weight = kernel_prepare

        def decode(engine, batch: int) -> tuple[float, float, int, list]:
            greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
            prompts = rng.integers(0, CONFIG["vocab_size"], (batch, 16)).tolist()
            for i, prompt in enumerate(prompts):
                engine.add_request(EngineCoreRequest(f"b{batch}-{i}-{time.monotonic_ns()}", prompt, greedy))
            started: set[str] = set()
            wall = cpu = 0.0
            steps = 0
            while engine.has_unfinished_requests():
                decoding = len(started) == batch
                t0, c0 = time.perf_counter(), time.process_time()
                outs = engine.step()
                if decoding:
                    wall += time.perf_counter() - t0
                    cpu += time.process_time() - c0
                    steps += 1
                started.update(o.request_id for o in outs if o.new_token_ids)
            return wall, cpu, steps, prompts

        load_before = os.getloadavg()
        best: dict[tuple[int, str], dict] = {}
        for _ in range(args.rounds):
            for batch in batches:
                for variant, engine in engines.items():
                    wall, cpu, steps, _ = decode(engine, batch)
                    row = {
                        "batch": batch,
                        "variant": variant,
                        "decode_steps": steps,
                        "tok_per_s": round(batch * steps / wall, 1),
                        "ms_per_step": round(1000 * wall / steps, 2),
                        "cpu_ms_per_step": round(1000 * cpu / steps, 2),
                    }
                    key = (batch, variant)
                    if key not in best or row["tok_per_s"] > best[key]["tok_per_s"]:
                        best[key] = row
        load_after = os.getloadavg()

    rows = [best[(b, v)] for b in batches for v in ("reference", "kernel")]
    for b in batches:
        ref, ker = best[(b, "reference")], best[(b, "kernel")]
        ker["speedup_wall"] = round(ker["tok_per_s"] / ref["tok_per_s"], 2)
        ker["speedup_cpu"] = round(ref["cpu_ms_per_step"] / ker["cpu_ms_per_step"], 2)
    result = {
        **run_stamp(),
        "config": CONFIG,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "threads": os.environ.get("FD_CPU_KERNEL_THREADS") or os.environ.get("OMP_NUM_THREADS"),
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_after": [round(v, 2) for v in load_after],
        "rows": rows,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
