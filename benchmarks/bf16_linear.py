"""``--dtype bfloat16`` against float32 on the default model: prefill, batch-16 decode, greedy agreement.

Usage: python benchmarks/bf16_linear.py [--rounds 3] [--decode-steps 32] [--json benchmarks/results/bf16_linear.json]

One engine core per variant, all in this process (the engine's own path: scheduler, captured
decode steps, the cpu kernels), measured round-robin so machine noise hits them alike; the best
round is reported with all rounds beside it:

* ``float32``: today's default;
* ``bfloat16``: ``--dtype bfloat16`` (``fd_bf16_linear`` on the path the CPU chooses: ``vdpbf16ps``
  with AVX-512 BF16);
* ``bfloat16_widen``: the same weights through the widening path (``CpuOps.bf16_path = 1``, what a
  CPU without AVX-512 BF16 runs), which gives the same bits.

Prefill: one 512-token prompt, one step (time to its first token; prefix caching off, so every
round computes it). Decode: 16 requests (and, beside it, 1) with different prompts past their
prefill, then ``--decode-steps`` decode-only steps (replayed captured steps after the first two). Accuracy: the first 64 greedy tokens of a few chat
prompts, bfloat16 against float32 (how many agree before the first difference; reported, not
asserted). Threads: OMP_NUM_THREADS and FD_CPU_KERNEL_THREADS (default 2 each). Not part of the
test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of copper.",
    "Translate 'good morning' into Spanish and German.",
]


def cpu_facts() -> dict:
    flags: list[str] = []
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                break
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    except OSError:
        model = ""
    return {
        "lscpu_model_name": model,
        "bf16_flags": {f: f in flags for f in ("avx512_bf16", "amx_bf16", "amx_tile", "amx_int8", "avx512_vnni")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--agree-tokens", type=int, default=64)
    parser.add_argument("--variants", default="float32,bfloat16,bfloat16_widen")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    os.environ.setdefault("FD_CPU_KERNEL_THREADS", "2")

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [root, os.path.join(root, "benchmarks")]
    from run_stamp import run_stamp

    from fastdeploy_core.builtin.cpu.kernels import matrix_paths
    from fastdeploy_core.config import EngineArgs
    from fastdeploy_core.engine.engine_core import EngineCore
    from fastdeploy_core.engine.outputs import EngineCoreRequest
    from fastdeploy_core.engine.sampling_params import SamplingParams
    from fastdeploy_core.tokenizer import load_tokenizer

    load_start = os.getloadavg()
    cores: dict[str, EngineCore] = {}
    for variant in args.variants.split(","):
        dtype = "bfloat16" if variant.startswith("bfloat16") else "float32"
        core = EngineCore(
            EngineArgs.create(
                dtype=dtype,
                max_num_seqs=16,
                max_model_len=2048,
                num_gpu_blocks_override=160,
                enable_prefix_caching=False,  # every round computes its whole prompt
            )
        )
        if variant == "bfloat16_widen":
            core.runner.ops.bf16_path = 1  # before any step: captured steps keep the path they ran
        cores[variant] = core
    tokenizer = load_tokenizer(next(iter(cores.values())).runner.source)

    def chat(text: str) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))

    long_ids = (chat(" ".join(PROMPTS * 40)) * 2)[: args.prompt_tokens]
    decode_prompts = [chat(f"{PROMPTS[i % len(PROMPTS)]} (variant {i})") for i in range(16)]
    counter = iter(range(10**9))

    def drain(core: EngineCore) -> None:
        while core.has_unfinished_requests():
            core.step()

    def prefill_ms(core: EngineCore) -> float:
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        core.add_request(EngineCoreRequest(f"p{next(counter)}", list(long_ids), params))
        t = time.perf_counter()
        while core.has_unfinished_requests():
            core.step()
        return (time.perf_counter() - t) * 1e3

    def decode_tok_s(core: EngineCore, batch: int = 16) -> float:
        params = SamplingParams(temperature=0, max_tokens=args.decode_steps + 8, ignore_eos=True)
        ids = [f"d{next(counter)}" for _ in decode_prompts[:batch]]
        for rid, prompt in zip(ids, decode_prompts[:batch]):
            core.add_request(EngineCoreRequest(rid, prompt, params))
        for _ in range(4):  # prompts (one step with the default budget) and the first decode steps
            core.step()
        t = time.perf_counter()
        for _ in range(args.decode_steps):
            core.step()
        elapsed = time.perf_counter() - t
        drain(core)
        return batch * args.decode_steps / elapsed

    results = {v: {"prefill_ms": [], "decode_tok_s": [], "decode_batch1_tok_s": []} for v in cores}
    for core in cores.values():  # warm-up: kernels loaded, graphs of batch 16 and 1 recorded
        prefill_ms(core)
        decode_tok_s(core)
        decode_tok_s(core, 1)
    for _ in range(args.rounds):
        for variant, core in cores.items():
            results[variant]["prefill_ms"].append(round(prefill_ms(core), 1))
            results[variant]["decode_tok_s"].append(round(decode_tok_s(core), 1))
            results[variant]["decode_batch1_tok_s"].append(round(decode_tok_s(core, 1), 1))

    # Greedy agreement with float32 over the first tokens of each chat prompt.
    def greedy(core: EngineCore) -> tuple[list[list[int]], list[list[dict]]]:
        params = SamplingParams(temperature=0, max_tokens=args.agree_tokens, ignore_eos=True, logprobs=5)
        ids = [f"a{next(counter)}" for _ in PROMPTS]
        for rid, text in zip(ids, PROMPTS):
            core.add_request(EngineCoreRequest(rid, chat(text), params))
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        lps: dict[str, list[dict]] = {rid: [] for rid in ids}
        while core.has_unfinished_requests():
            for o in core.step():
                out[o.request_id].extend(o.new_token_ids)
                lps[o.request_id].extend(o.new_logprobs or [])
        return [out[rid] for rid in ids], [lps[rid] for rid in ids]

    agreement = {}
    if "float32" in cores:
        base, base_lps = greedy(cores["float32"])
        for variant, core in cores.items():
            if variant == "float32":
                continue
            tokens, _ = greedy(core)
            firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(base, tokens)]
            agreement[variant] = {
                "tokens_agreeing_before_first_difference": firsts,
                "identical_prompts": sum(f == args.agree_tokens for f in firsts),
                # float32's logprob of its own token minus that of the bfloat16 run's token at the
                # first difference (None: identical, or the token is not in float32's top 5)
                "float32_margin_at_first_difference": [
                    None
                    if f == args.agree_tokens or y[f] not in lp[f]
                    else round(lp[f][x[f]] - lp[f][y[f]], 4)
                    for f, x, y, lp in zip(firsts, base, tokens, base_lps)
                ],
                "of": len(PROMPTS),
                "texts_first_difference": [
                    None if f == args.agree_tokens else [tokenizer.decode(x[: f + 8]), tokenizer.decode(y[: f + 8])]
                    for f, x, y in zip(firsts, base, tokens)
                ],
            }

    summary = {}
    base_prefill = min(results["float32"]["prefill_ms"]) if "float32" in results else None
    base_decode = max(results["float32"]["decode_tok_s"]) if "float32" in results else None
    for variant, r in results.items():
        best_p, best_d = min(r["prefill_ms"]), max(r["decode_tok_s"])
        summary[variant] = {
            "prefill_512_ms": best_p,
            "prefill_tok_s": round(args.prompt_tokens / best_p * 1e3, 1),
            "decode_batch16_tok_s": best_d,
            "decode_batch1_tok_s": max(r["decode_batch1_tok_s"]),
            "prefill_speedup_vs_float32": round(base_prefill / best_p, 2) if base_prefill else None,
            "decode_speedup_vs_float32": round(best_d / base_decode, 2) if base_decode else None,
            "rounds": r,
            "linear_weights": cores[variant].runner.describe()["linear_weights"],
            "graph_capture": cores[variant].runner.describe()["graph_capture"],
        }
        print(f"{variant:<16} prefill {best_p:8.1f} ms  decode(16) {best_d:7.1f} tok/s  decode(1) "
              f"{max(r['decode_batch1_tok_s']):6.1f} tok/s   rounds {r}")
    for variant, a in agreement.items():
        print(f"{variant:<16} greedy agreement with float32 (first {args.agree_tokens}): {a['tokens_agreeing_before_first_difference']}")
    record = {
        **run_stamp(),
        **cpu_facts(),
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "threads": {"omp": os.environ["OMP_NUM_THREADS"], "kernel_pool": os.environ["FD_CPU_KERNEL_THREADS"]},
        "kernel_paths": matrix_paths(),
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (embedded default), weights dequantized to float32 / rounded to bfloat16",
        "prompt_tokens": args.prompt_tokens,
        "decode_steps": args.decode_steps,
        "variants": summary,
        "greedy_agreement_vs_float32": agreement,
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=1)


if __name__ == "__main__":
    main()
