"""Speculative decoding (ngram) against one-token decoding, batch 1, default model, one run.

    .venv/bin/python benchmarks/spec_decode.py [--tokens 128] [--rounds 2]

Two engines (speculation off, and ``{"method": "ngram", "num_speculative_tokens": K}``) are
loaded side by side; each round decodes the same prompts greedily on both, alternating, so a
change in the machine's load hits both alike. Workloads: an input-grounded prompt (rewrite the
given code: prompt lookup finds its continuations) and a plain chat prompt (little to find).
For each: decode tokens per second by wall clock and by this process's CPU time (the machine
is shared with other work, so the wall clock alone overstates slowdowns), the acceptance rate
and the tokens per step, and whether the tokens were identical (they must be). Decode time
excludes the prompt step: the time to first token is subtracted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "plugins", "fd-llama"), os.path.join(ROOT, "benchmarks")]

CODE = '''def merge_sort(items):
    if len(items) <= 1:
        return items
    middle = len(items) // 2
    left = merge_sort(items[:middle])
    right = merge_sort(items[middle:])
    merged = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged
'''
WORKLOADS = {
    "grounded (rewrite code)": [{"role": "user", "content": f"Rewrite this function with type hints:\n\n{CODE}"}],
    "plain chat": [{"role": "user", "content": "Describe a walk in a forest in autumn."}],
}


def decode_once(llm, messages, tokens: int) -> dict:
    from fastdeploy_core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    core = llm.engine.core
    before = core.get_stats()
    first_wall = first_cpu = None
    out_tokens: list[int] = []
    text = llm.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt = list(llm.engine.tokenizer.encode(text, add_special_tokens=False))
    from fastdeploy_core.engine.outputs import EngineCoreRequest

    core.add_request(EngineCoreRequest("bench", prompt, params))
    while core.has_unfinished_requests():
        for out in core.step():
            if first_wall is None:
                first_wall, first_cpu = time.perf_counter(), time.process_time()
                out_tokens.extend(out.new_token_ids[1:])
            else:
                out_tokens.extend(out.new_token_ids)
    wall, cpu = time.perf_counter() - first_wall, time.process_time() - first_cpu
    after = core.get_stats()
    n = len(out_tokens)
    drafts = after.get("spec_decode_num_draft_tokens_total", 0) - before.get("spec_decode_num_draft_tokens_total", 0)
    accepted = after.get("spec_decode_num_accepted_tokens_total", 0) - before.get(
        "spec_decode_num_accepted_tokens_total", 0)
    return {"tokens": out_tokens, "wall_tps": n / wall, "cpu_tps": n / cpu, "drafts": drafts, "accepted": accepted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    args = ap.parse_args()

    from run_stamp import run_stamp

    from fastdeploy_core import LLM

    common = {"max_model_len": 1024, "num_gpu_blocks_override": 32, "max_num_seqs": 1}
    engines = {
        "off": LLM(**common),
        "ngram": LLM(**common, speculative_config={"method": "ngram", "num_speculative_tokens": args.k}),
    }
    stamp = run_stamp()
    load = os.getloadavg()
    print(f"# speculative decoding, batch 1, default model, {args.tokens} tokens, {args.rounds} rounds, k={args.k}")
    print(f"# {stamp['date']}, {stamp['cpu_model']}, {stamp['cpus']} cpus, OMP_NUM_THREADS="
          f"{os.environ['OMP_NUM_THREADS']}, load average {load[0]:.1f} {load[1]:.1f} (shared machine)")
    for name, messages in WORKLOADS.items():
        runs: dict[str, list[dict]] = {"off": [], "ngram": []}
        decode_once(engines["off"], messages, 8)  # warm-up: graphs captured, caches paged in
        decode_once(engines["ngram"], messages, 8)
        for _ in range(args.rounds):
            for key in ("off", "ngram"):
                runs[key].append(decode_once(engines[key], messages, args.tokens))
        same = all(r["tokens"] == runs["off"][0]["tokens"] for r in runs["off"] + runs["ngram"])
        off_w = statistics.median(r["wall_tps"] for r in runs["off"])
        on_w = statistics.median(r["wall_tps"] for r in runs["ngram"])
        off_c = statistics.median(r["cpu_tps"] for r in runs["off"])
        on_c = statistics.median(r["cpu_tps"] for r in runs["ngram"])
        drafts = sum(r["drafts"] for r in runs["ngram"])
        accepted = sum(r["accepted"] for r in runs["ngram"])
        print(f"{name}: identical tokens {same}; decode tok/s wall off {off_w:.1f} ngram {on_w:.1f} "
              f"({on_w / off_w:.2f}x); per CPU-second off {off_c:.1f} ngram {on_c:.1f} ({on_c / off_c:.2f}x); "
              f"acceptance {accepted}/{drafts} = {accepted / max(1, drafts):.2f}")


if __name__ == "__main__":
    main()
