"""The PaddleFormers fallback beside the native model, for every architecture both serve.

For the installed PaddleFormers generation (0.4: Qwen2, Qwen3, Qwen3-MoE, ERNIE-4.5,
ERNIE-4.5-MoE, DeepSeek-V3; 1.x: Llama, ERNIE-4.5), a small random checkpoint of each
architecture is written by transformers (in a subprocess: importing PaddleFormers can hide torch
from transformers), all with the sizes of :data:`SIZES` (MoE and MLA dims in :data:`FAMILIES`).
Each checkpoint is served twice in this process, ``--model-impl fastdeploy`` (the native plugin)
and ``--model-impl paddleformers`` (the fallback), and decoded with ``fastdeploy bench
latency``'s measurement (same random prompts, prefill = until every request has its first
token, decode = the rest) at each batch size, the two implementations alternating round by round
so machine noise hits both alike. Prints a markdown table and writes
``benchmarks/results/paddleformers_fallback.json``, stamped with the date, CPU model and the
load average before and after the run.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/paddleformers_fallback.py [--rounds 2] [--families qwen3 ...]

Needs PaddleFormers, torch and transformers installed (plugins/fd-paddleformers/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
IMPLS = ("fastdeploy", "paddleformers")

#: what every benchmark checkpoint shares
SIZES = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
    initializer_range=0.02,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)
ROPE = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0))
MOE_WIDTH = 128
#: name -> (transformers config class, model class, family-specific config), per generation
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(**ROPE)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, **ROPE)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=MOE_WIDTH, norm_topk_prob=True, **ROPE),
    ),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(head_dim=32, use_bias=False, **ROPE)),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            head_dim=32,
            moe_num_experts=8,
            moe_k=2,
            moe_intermediate_size=MOE_WIDTH,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_end_index=3,
            moe_layer_interval=1,
            use_bias=False,
            **ROPE,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=8,
            q_lora_rank=128,
            kv_lora_rank=64,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            moe_intermediate_size=MOE_WIDTH,
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            num_nextn_predict_layers=0,  # transformers saves no MTP layer; the native model would ask for it
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
            ),
        ),
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(**ROPE)),
}
#: architectures both the native plugins and the installed generation's fallback serve
BOTH_SERVE = {
    "0.4": ["qwen2", "qwen3", "qwen3_moe", "ernie4_5", "ernie4_5_moe", "deepseek_v3"],
    "1": ["llama", "ernie4_5"],
}


def write_checkpoints(out_dir: str, names: list[str]) -> None:
    """(run in a subprocess) one random transformers checkpoint per name under ``out_dir``."""
    sys.modules.setdefault("torchcodec", None)  # paddlecodec's stand-in module trips transformers
    import torch
    import transformers

    from tokenizers import Tokenizer, models, pre_tokenizers

    # the engine loads a tokenizer with every model: a word-level one over the whole vocabulary
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(SIZES["vocab_size"])}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    for name in names:
        config_cls, model_cls, extra = FAMILIES[name]
        config = getattr(transformers, config_cls)(**{**SIZES, **extra})
        torch.manual_seed(0)
        path = os.path.join(out_dir, name)
        getattr(transformers, model_cls)(config).eval().save_pretrained(path)
        tokenizer.save(os.path.join(path, "tokenizer.json"))


def measure_family(path: str, batch_sizes: list[int], input_len: int, output_len: int, rounds: int) -> dict:
    from fastdeploy_core.cli.bench import measure_iteration, random_prompts
    from fastdeploy_core.config import EngineArgs
    from fastdeploy_core.engine.llm_engine import LLMEngine

    engines = {}
    for impl in IMPLS:
        engines[impl] = LLMEngine(
            EngineArgs.create(
                model=path, model_impl=impl, max_model_len=256, max_num_seqs=max(batch_sizes), num_gpu_blocks_override=256
            )
        )
    classes = {impl: type(engines[impl].core.runner.model).__name__ for impl in IMPLS}
    vocab = engines["fastdeploy"].core.vocab_size
    runs: dict = {impl: {b: [] for b in batch_sizes} for impl in IMPLS}
    for batch in batch_sizes:
        for impl in IMPLS:  # warm-up
            measure_iteration(engines[impl], random_prompts(batch, input_len, vocab, seed=99), 4)
        for r in range(rounds):
            prompts = random_prompts(batch, input_len, vocab, seed=r)
            for impl in IMPLS if r % 2 == 0 else reversed(IMPLS):
                runs[impl][batch].append(measure_iteration(engines[impl], prompts, output_len))
    out: dict = {"classes": classes}
    for batch in batch_sizes:
        row = {}
        for impl in IMPLS:
            row[impl] = {
                "decode_tok_s": statistics.median(x["decode_tok_s"] for x in runs[impl][batch]),
                "prefill_tok_s": statistics.median(x["prefill_tok_s"] for x in runs[impl][batch]),
                "decode_tok_s_all": [round(x["decode_tok_s"], 2) for x in runs[impl][batch]],
            }
        row["ratio"] = row["paddleformers"]["decode_tok_s"] / row["fastdeploy"]["decode_tok_s"]
        out[str(batch)] = row
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--write-checkpoints":
        write_checkpoints(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--families", nargs="+", default=None, help="a subset of the installed generation's")
    args = parser.parse_args()

    from importlib import metadata

    import paddle
    from run_stamp import run_stamp

    version = metadata.version("paddleformers")
    names = BOTH_SERVE["0.4" if version.startswith("0.4") else "1"]
    if args.families:
        unknown = sorted(set(args.families) - set(names))
        if unknown:
            parser.error(f"not served by both implementations on PaddleFormers {version}: {', '.join(unknown)}")
        names = [n for n in names if n in args.families]
    summary = {
        **run_stamp(),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "omp_num_threads": os.environ["OMP_NUM_THREADS"],
        "paddle": paddle.__version__,
        "paddleformers": version,
        "checkpoints": {
            "shared": {k: v for k, v in SIZES.items() if v is not None},
            **{n: {k: v for k, v in FAMILIES[n][2].items()} for n in names},
        },
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rounds": args.rounds,
        "peer": "the native plugin (--model-impl fastdeploy) on the same checkpoint, in the same process and run",
        "results": {},
    }
    lines = [
        "| architecture | batch | native decode tok/s | fallback decode tok/s | fallback / native |",
        "|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="pf_bench_") as tmp:
        proc = subprocess.run([sys.executable, __file__, "--write-checkpoints", tmp, *names], check=False)
        if proc.returncode:
            raise SystemExit("writing the checkpoints with transformers failed")
        for name in names:
            t0 = time.perf_counter()
            result = measure_family(
                os.path.join(tmp, name), args.batch_sizes, args.input_len, args.output_len, args.rounds
            )
            summary["results"][name] = result
            print(f"{name}: {result['classes']} measured in {time.perf_counter() - t0:.0f} s", flush=True)
            for batch in args.batch_sizes:
                row = result[str(batch)]
                lines.append(
                    f"| {name} | {batch} | {row['fastdeploy']['decode_tok_s']:.1f} | "
                    f"{row['paddleformers']['decode_tok_s']:.1f} | {row['ratio']:.2f} |"
                )
    summary["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print("\n".join(lines))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "paddleformers_fallback.json"), "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
