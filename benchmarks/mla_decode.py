"""Decode tok/s and KV bytes per token: multi-head latent attention against an equal-size GQA model.

Usage: python benchmarks/mla_decode.py [--prompt 256] [--tokens 32] [--rounds 2] [--batches 1,16]
                                       [--json FILE --section NAME]

Two tiny random models with the same hidden size (512), layers (4), query heads (8), MLP (1024,
SiLU-gated, dense: DeepSeek-V3's ``first_k_dense_replace`` covers every layer, no experts) and
vocabulary (4096), written by transformers as safetensors into temporary directories and served
by in-process engines (``EngineCore``) on the cpu device:

- **mla**: ``DeepseekV3ForCausalLM``, ``q_proj`` (no q low-rank pair), ``kv_lora_rank`` 128,
  ``qk_nope_head_dim`` 64, ``qk_rope_head_dim`` 32, ``v_head_dim`` 64. Its cache holds one latent
  row of 128 + 32 floats per token and layer; decode steps run ``mla_paged_attention``'s
  absorbed form (the model always runs eager: ``supports_graph_capture`` is False).
- **gqa**: ``LlamaForCausalLM``, 8 query heads of 64 over 4 KV heads (K and V of 4 x 64 floats
  each per token and layer), ``rope_paged_attention``; with the engine's default captured decode
  steps ("gqa") and with ``enforce_eager`` ("gqa eager", the like-for-like peer of the eager MLA
  model).

Attention parameters per layer (the four projections, biases none): MLA 512x768 (q) + 512x160
(kv_a) + 128x1024 (kv_b) + 512x512 (o) = 868,352; GQA 512x512 (q) + 2 x 512x256 (k, v) +
512x512 (o) = 786,432 (0.91x; 8 KV heads would make it 1,048,576, 1.21x). The script records
both counts from the loaded models.

When the cpu ops table has its own ``mla_paged_attention`` (the ``fd_mla_decode`` kernel), a
fourth engine, "mla reference", runs the same MLA checkpoint with ``CpuOps.mla_paged_attention``
replaced by the plain-Paddle ``ReferenceOps.mla_paged_attention``: kernel against reference in
the same run.

Each round runs every (batch, variant) once, round-robin so machine noise hits them alike, with
the same prompts of ``--prompt`` random tokens and ``--tokens`` greedy tokens each; only steps in
which every request decodes are timed (so the context grows from ``--prompt`` to
``--prompt + --tokens``). The best round is reported: wall-clock tok/s, process CPU time per
decode step, and the CPU time inside the attention op (the model's ``mla_paged_attention`` or
``rope_paged_attention``, wrapped by a timer; 0 for replayed graphs, which call no op). KV bytes
per token are the runner's (``describe()["kv_cache_spec"]``) summed over the layers. Not part of
the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

COMMON = {
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

MLA_CONFIG = {
    **COMMON,
    "num_key_value_heads": 8,
    "q_lora_rank": None,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "first_k_dense_replace": 4,  # every layer a dense MLP: no experts
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 256,
    "num_mtp_layers": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}

GQA_CONFIG = {**COMMON, "num_key_value_heads": 4, "head_dim": 64, "rope_theta": 10000.0}


def write_models(mla_path: str, gqa_path: str) -> dict:
    """Both checkpoints; returns each model's attention parameter count per layer."""
    import torch
    import transformers

    torch.manual_seed(0)
    mla = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**MLA_CONFIG)).eval()
    mla.save_pretrained(mla_path, safe_serialization=True)
    torch.manual_seed(0)
    gqa = transformers.LlamaForCausalLM(transformers.LlamaConfig(**GQA_CONFIG)).eval()
    gqa.save_pretrained(gqa_path, safe_serialization=True)

    def attention_parameters(model) -> int:
        layer = model.model.layers[0].self_attn
        # the projections only: MLA's two small RMSNorm weights (128 numbers) left out
        return sum(p.numel() for name, p in layer.named_parameters() if "layernorm" not in name)

    return {
        "mla": attention_parameters(mla),
        "gqa": attention_parameters(gqa),
        "mla_total": sum(p.numel() for p in mla.parameters()),
        "gqa_total": sum(p.numel() for p in gqa.parameters()),
    }


class AttentionClock:
    """Process CPU time spent inside the wrapped attention ops."""

    def __init__(self) -> None:
        self.cpu = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            c0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu += time.process_time() - c0

        return timed


def decode(engine, prompts: list, tokens: int, clock: AttentionClock) -> dict:
    from fastdeploy_core.engine.outputs import EngineCoreRequest
    from fastdeploy_core.engine.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    batch = len(prompts)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineCoreRequest(f"b{batch}-{i}-{time.monotonic_ns()}", prompt, greedy))
    started: set[str] = set()
    wall = cpu = attention = 0.0
    steps = 0
    while engine.has_unfinished_requests():
        decoding = len(started) == batch
        a0 = clock.cpu
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.step()
        if decoding:
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            attention += clock.cpu - a0
            steps += 1
        started.update(o.request_id for o in outs if o.new_token_ids)
    return {"wall": wall, "cpu": cpu, "attention": attention, "steps": steps}


def measure(args) -> dict:
    import numpy as np

    from fastdeploy_core.builtin.cpu.ops import CpuOps
    from fastdeploy_core.config import EngineArgs
    from fastdeploy_core.devices.reference_ops import ReferenceOps
    from fastdeploy_core.engine.engine_core import EngineCore

    batches = [int(b) for b in args.batches.split(",")]
    has_kernel = CpuOps.mla_paged_attention is not ReferenceOps.mla_paged_attention
    clock = AttentionClock()
    own_mla, own_rope = CpuOps.mla_paged_attention, CpuOps.rope_paged_attention
    use_reference = {"on": False}

    def mla_paged_attention(self, *a, **k):
        fn = ReferenceOps.mla_paged_attention if use_reference["on"] else own_mla
        return fn(self, *a, **k)

    CpuOps.mla_paged_attention = clock.wrap(mla_paged_attention)
    CpuOps.rope_paged_attention = clock.wrap(own_rope)
    rng = np.random.default_rng(0)
    try:
        with tempfile.TemporaryDirectory() as mla_path, tempfile.TemporaryDirectory() as gqa_path:
            params = write_models(mla_path, gqa_path)
            base = {"max_model_len": args.prompt + args.tokens + 8, "num_gpu_blocks_override": 160, "block_size": 32}
            engines = {
                "mla": EngineCore(EngineArgs.create(model=mla_path, **base)),
                "gqa": EngineCore(EngineArgs.create(model=gqa_path, **base)),
                "gqa eager": EngineCore(EngineArgs.create(model=gqa_path, enforce_eager=True, **base)),
            }
            if has_kernel:
                engines["mla reference"] = engines["mla"]
            kv = {}
            for name in ("mla", "gqa"):
                spec = engines[name].runner.describe()["kv_cache_spec"]
                kv[name] = {
                    "bytes_per_token_per_layer": spec["bytes_per_token_per_layer"],
                    "bytes_per_token": spec["bytes_per_token_per_layer"] * spec["num_layers"],
                    "token_shapes": spec["token_shapes"],
                }
            graphs = {}
            for name in ("mla", "gqa", "gqa eager"):
                g = engines[name].runner.graphs
                graphs[name] = "off" if g is None else (g.disabled_reason or "on")

            load_before = os.getloadavg()
            best: dict[tuple[int, str], dict] = {}
            for _ in range(args.rounds):
                for batch in batches:
                    prompts = rng.integers(3, COMMON["vocab_size"], (batch, args.prompt)).tolist()
                    for variant, engine in engines.items():
                        use_reference["on"] = variant == "mla reference"
                        run = decode(engine, prompts, args.tokens, clock)
                        r = {
                            "batch": batch,
                            "variant": variant,
                            "decode_steps": run["steps"],
                            "tok_per_s": round(batch * run["steps"] / run["wall"], 1),
                            "ms_per_step": round(1000 * run["wall"] / run["steps"], 2),
                            "cpu_ms_per_step": round(1000 * run["cpu"] / run["steps"], 2),
                            "attention_cpu_ms_per_step": round(1000 * run["attention"] / run["steps"], 2),
                        }
                        key = (batch, variant)
                        if key not in best or r["tok_per_s"] > best[key]["tok_per_s"]:
                            best[key] = r
            load_after = os.getloadavg()
    finally:
        CpuOps.mla_paged_attention, CpuOps.rope_paged_attention = own_mla, own_rope
    variants = list(engines)
    rows = [best[(b, v)] for b in batches for v in variants]
    for b in batches:
        for v in variants:
            best[(b, v)]["mla_vs_this_wall"] = round(best[(b, "mla")]["tok_per_s"] / best[(b, v)]["tok_per_s"], 2)
    return {
        "mla_kernel": has_kernel,
        "attention_parameters_per_layer": {"mla": params["mla"], "gqa": params["gqa"]},
        "parameters_total": {"mla": params["mla_total"], "gqa": params["gqa_total"]},
        "kv_cache": kv,
        "decode_graphs": graphs,
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_after": [round(v, 2) for v in load_after],
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--json", help="result file; only --section's entry is replaced")
    parser.add_argument("--section", default="run", help="the result file's key for this run")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.path.insert(0, HERE)
    from run_stamp import run_stamp

    found = measure(args)
    result = {
        **run_stamp(),
        "mla_config": MLA_CONFIG,
        "gqa_config": GQA_CONFIG,
        "prompt_tokens": args.prompt,
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
        sections[args.section] = result
        with open(args.json, "w") as fh:
            json.dump(sections, fh, indent=1)


if __name__ == "__main__":
    main()
