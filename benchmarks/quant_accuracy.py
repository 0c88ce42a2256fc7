"""Accuracy and memory of each quantization method on the default model (or --model).

Usage: python benchmarks/quant_accuracy.py [--methods ...] [--json benchmarks/results/quant_accuracy.json]

For each method, through the engine (``EngineCore``, the same path ``LLM`` uses):

* perplexity on ``tests/quantization/data/perplexity_text.txt`` (non-overlapping windows of
  ``--window`` tokens, every token after the first of a window scored via prompt logprobs);
* greedy agreement with float32 on a fixed set of chat prompts: generated tokens equal to
  float32's up to the first difference (prefix agreement), exact matches, and teacher-forced
  top-1 agreement on float32's continuations;
* bytes of weights (parameters and buffers of the model) and of KV cache per token.

Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 11?",
    "Give one tip for sleeping better.",
]

METHODS = {
    "float32": None,
    "wint8": "wint8",
    "wint4": "wint4",
    "wint4_g128": '{"quantization": "wint4", "group_size": 128}',
    "wint8_float_head": '{"quantization": "wint8", "lm_head_quant_type": null}',
    # wint8 through fd_int8_linear's float32 loop instead of the integer products (CpuOps.wint8_int_dot)
    "wint8:fma": "wint8",
    "w8a8": "w8a8",
    "w8a8_w8a8_head": '{"quantization": "w8a8", "lm_head_quant_type": "w8a8"}',
    "w4a8": "w4a8",
    "block_wise_fp8": "block_wise_fp8",
    "kv_int8": '{"kv_cache_quant_type": "int8"}',
    "wint8+kv_int8": '{"quantization": "wint8", "kv_cache_quant_type": "int8"}',
    # engine settings other than --quantization: bfloat16 linear layers and/or a bfloat16 KV cache
    "bf16": {"dtype": "bfloat16"},
    "kv_bf16": {"kv_cache_dtype": "bfloat16"},
    "bf16+kv_bf16": {"dtype": "bfloat16", "kv_cache_dtype": "bfloat16"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")

    import numpy as np

    from fastdeploy_core.config import EngineArgs
    from fastdeploy_core.engine.engine_core import EngineCore
    from fastdeploy_core.engine.outputs import EngineCoreRequest
    from fastdeploy_core.engine.sampling_params import SamplingParams
    from fastdeploy_core.tokenizer import load_tokenizer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "tests", "quantization", "data", "perplexity_text.txt")) as fh:
        text = fh.read()

    def run(core, requests):
        for rid, ids, params in requests:
            core.add_request(EngineCoreRequest(rid, ids, params))
        outs: dict[str, dict] = {}
        while core.has_unfinished_requests():
            for out in core.step():
                entry = outs.setdefault(out.request_id, {"tokens": [], "prompt_logprobs": None})
                entry["tokens"].extend(out.new_token_ids)
                if out.prompt_logprobs is not None:
                    entry["prompt_logprobs"] = out.prompt_logprobs
        return outs

    from fastdeploy_core.builtin.cpu.ops import CpuOps

    quads_default = CpuOps.wint8_int_dot
    results: dict[str, dict] = {}
    reference: dict | None = None
    for name in args.methods.split(","):
        spec = METHODS[name]
        CpuOps.wint8_int_dot = quads_default and not name.endswith(":fma")
        t0 = time.perf_counter()
        settings = {"model": args.model, "max_model_len": 1024, "num_gpu_blocks_override": 64, "block_size": 64}
        if isinstance(spec, dict):
            settings.update(spec)
        elif spec:
            settings["quantization"] = spec
        core = EngineCore(EngineArgs.create(**settings))
        runner = core.runner
        tokenizer = load_tokenizer(runner.source)
        ids = tokenizer.encode(text)
        windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
        windows = [w for w in windows if len(w) > 1]
        scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
        outs = run(core, [(f"w{i}", w, scoring) for i, w in enumerate(windows)])
        logprobs = []
        for i, w in enumerate(windows):
            entries = outs[f"w{i}"]["prompt_logprobs"]
            logprobs += [entries[j][w[j]] for j in range(1, len(w))]
        ppl = math.exp(-float(np.mean(logprobs)))

        prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
        greedy = SamplingParams(temperature=0, max_tokens=args.max_new, ignore_eos=True)
        gen = run(core, [(f"g{i}", p, greedy) for i, p in enumerate(prompts)])
        tokens = [gen[f"g{i}"]["tokens"] for i in range(len(prompts))]

        weights = 0
        for tensor in list(runner.model.parameters()) + list(runner.model.buffers()):
            weights += int(np.prod(tensor.shape)) * tensor.element_size()
        kv_per_token = runner.bytes_per_block // runner.block_size

        entry = {
            "perplexity": round(ppl, 4),
            "scored_tokens": len(logprobs),
            "weights_mib": round(weights / 2**20, 1),
            "kv_bytes_per_token": kv_per_token,
            "load_s": round(time.perf_counter() - t0, 1),
            "sample": tokenizer.decode(tokens[0])[:80],
        }
        if reference is None and name == "float32":
            reference = {"tokens": tokens, "ppl": ppl, "prompts": prompts}
        elif reference is not None:
            prefix = exact = 0
            for got, want in zip(tokens, reference["tokens"]):
                n = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
                prefix += n
                exact += got == want
            forced = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, ignore_eos=True)
            seqs = [p + t for p, t in zip(reference["prompts"], reference["tokens"])]
            tf = run(core, [(f"t{i}", s, forced) for i, s in enumerate(seqs)])
            top1 = []
            for i, (p, s) in enumerate(zip(reference["prompts"], seqs)):
                entries = tf[f"t{i}"]["prompt_logprobs"]
                for j in range(len(p), len(s)):
                    top1.append(max(entries[j], key=entries[j].get) == s[j])
            entry.update(
                perplexity_vs_float32=f"{100 * (ppl / reference['ppl'] - 1):+.2f}%",
                greedy_prefix_agreement=round(prefix / (len(PROMPTS) * args.max_new), 3),
                greedy_exact_matches=f"{exact}/{len(PROMPTS)}",
                teacher_forced_top1=round(float(np.mean(top1)), 3),
            )
        results[name] = entry
        print(name, json.dumps(entry), flush=True)
        del core, runner

    if args.json:
        from run_stamp import run_stamp

        with open(args.json, "w") as fh:
            json.dump({**run_stamp(), "methods": results}, fh, indent=1)


if __name__ == "__main__":
    main()
