"""vLLM-CPU's side of benchmarks/prefill_peers.py: prefill time and decode speed per prompt.

Runs inside vLLM's own virtualenv (it imports nothing of ours). Reads a JSON list of token-id
prompts, runs each alone (prefix caching off, greedy, eos ignored) through ``vllm.LLM`` with the
engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so ``time.process_time`` covers
every thread that computes. Each prompt runs once untimed first (a warm-up at that length).
Prefill = a request with ``max_tokens=1``; decode = the same prompt with ``1 + decode_tokens``
tokens, minus the prefill. Prints one JSON object per prompt.

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
      ~/.cache/fastdeploy-peers/vllm-cpu/bin/python benchmarks/vllm_long_context.py MODEL_DIR PROMPTS.json \\
      --dtype bfloat16 --decode-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f}/{five:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("prompts", help="JSON file: a list of token-id lists")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=8192)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.prompts, encoding="utf-8") as fh:
        prompts = json.load(fh)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              enable_prefix_caching=False, seed=0)

    def timed(prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        w, c = time.perf_counter(), time.process_time()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return time.perf_counter() - w, time.process_time() - c, len(out[0].outputs[0].token_ids)

    timed(prompts[0][:256], 2)  # warm-up, untimed
    for prompt in prompts:
        # untimed, once per length: vLLM's first forward at a new length costs more than the next
        # ones (measured: at 8,000 tokens a 1-token request took longer than the 17-token one after it)
        timed(prompt, 1)
        load_before = _load()
        pre_wall, pre_cpu, _ = timed(prompt, 1)
        full_wall, full_cpu, n = timed(prompt, 1 + args.decode_tokens)
        decode_wall, decode_cpu = full_wall - pre_wall, full_cpu - pre_cpu
        print(json.dumps({
            "prompt_tokens": len(prompt),
            "prefill_wall_s": round(pre_wall, 3),
            "prefill_cpu_s": round(pre_cpu, 3),
            "decode_steps": n - 1,
            "decode_tok_s_wall": round((n - 1) / decode_wall, 2) if decode_wall > 0 else None,
            "decode_tok_s_cpu": round((n - 1) / decode_cpu, 2) if decode_cpu > 0 else None,
            "load_before": load_before,
            "load_after": _load(),
        }), flush=True)


if __name__ == "__main__":
    main()
