"""Speculative decoding against one-token decoding, batch 1, default model (float32 target).

    .venv/bin/python benchmarks/spec_decode.py [--tokens 96] [--rounds 2] [--draft-k 2,3,4] [--ngram-k 4]

Engines loaded side by side: speculation off; ``{"method": "ngram", "num_speculative_tokens":
NGRAM_K}``; and for each K of ``--draft-k`` a self-draft ``{"method": "draft_model",
"quantization": "wint4", "num_speculative_tokens": K}`` (the target's own checkpoint, its
weights in int4, as the draft). Each round decodes the same prompts greedily on every engine
in turn, so a change in the machine's load hits all alike. Workloads: an input-grounded prompt
(rewrite the given code: prompt lookup finds its continuations) and a plain chat prompt (little
to find in the context; a draft model still guesses).

For each: decode tokens per second by wall clock and by this process's CPU time (the machine
is shared with other work, so the wall clock alone overstates slowdowns), the acceptance rate,
the emitted tokens per speculative step, and whether the tokens were identical to speculation
off (they must be). Decode time excludes the prompt step: the time to first token is
subtracted. Results: ``benchmarks/results/spec_decode.json`` (with the date, CPU model and load
average).
"""

from __future__ import annotations

import argparse
import json
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
    from fastdeploy_core.engine.outputs import EngineCoreRequest

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    core = llm.engine.core
    before = core.get_stats()
    first_wall = first_cpu = None
    out_tokens: list[int] = []
    text = llm.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt = list(llm.engine.tokenizer.encode(text, add_special_tokens=False))
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

    def delta(key: str) -> int:
        return after.get(key, 0) - before.get(key, 0)

    n = len(out_tokens)
    return {
        "tokens": out_tokens, "wall_tps": n / wall, "cpu_tps": n / cpu,
        "drafts": delta("spec_decode_num_draft_tokens_total"),
        "accepted": delta("spec_decode_num_accepted_tokens_total"),
        "emitted": delta("spec_decode_num_emitted_tokens_total"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--draft-k", default="2,3,4", help="num_speculative_tokens of the wint4 self-drafts")
    ap.add_argument("--ngram-k", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "spec_decode.json"))
    args = ap.parse_args()

    from run_stamp import run_stamp

    from fastdeploy_core import LLM

    common = {"max_model_len": 1024, "num_gpu_blocks_override": 32, "max_num_seqs": 1}
    specs: dict[str, dict | None] = {
        "off": None,
        f"ngram k={args.ngram_k}": {"method": "ngram", "num_speculative_tokens": args.ngram_k},
    }
    for k in (int(k) for k in args.draft_k.split(",") if k.strip()):  # "" : no self-draft
        specs[f"self-draft wint4 k={k}"] = {
            "method": "draft_model", "quantization": "wint4", "num_speculative_tokens": k,
        }
    engines = {name: LLM(**common, speculative_config=spec) for name, spec in specs.items()}
    stamp = run_stamp()
    load_before = os.getloadavg()
    print(f"# speculative decoding, batch 1, default model (float32 target), {args.tokens} tokens, "
          f"{args.rounds} rounds")
    print(f"# {stamp['date']}, {stamp['cpu_model']}, {stamp['cpus']} cpus, OMP_NUM_THREADS="
          f"{os.environ['OMP_NUM_THREADS']}, load average {load_before[0]:.1f} {load_before[1]:.1f} (shared machine)")
    results: dict[str, dict] = {}
    for workload, messages in WORKLOADS.items():
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for llm in engines.values():
            decode_once(llm, messages, 8)  # warm-up: graphs captured, caches paged in
        for _ in range(args.rounds):
            for name, llm in engines.items():
                runs[name].append(decode_once(llm, messages, args.tokens))
        reference = runs["off"][0]["tokens"]
        off_wall = statistics.median(r["wall_tps"] for r in runs["off"])
        off_cpu = statistics.median(r["cpu_tps"] for r in runs["off"])
        rows = {}
        for name, got in runs.items():
            wall = statistics.median(r["wall_tps"] for r in got)
            cpu = statistics.median(r["cpu_tps"] for r in got)
            drafts, accepted = sum(r["drafts"] for r in got), sum(r["accepted"] for r in got)
            emitted = sum(r["emitted"] for r in got)
            row = {
                "spec": specs[name],
                "identical_tokens": all(r["tokens"] == reference for r in got),
                "decode_tok_s_wall": round(wall, 2), "decode_tok_s_wall_runs": [round(r["wall_tps"], 2) for r in got],
                "decode_tok_s_per_cpu_second": round(cpu, 2),
                "speedup_wall": round(wall / off_wall, 2), "speedup_per_cpu_second": round(cpu / off_cpu, 2),
            }
            if specs[name] is not None:
                steps = emitted - accepted  # speculative row-steps
                row.update(
                    draft_tokens=drafts, accepted_tokens=accepted,
                    acceptance_rate=round(accepted / max(1, drafts), 3),
                    tokens_per_speculative_step=round(emitted / max(1, steps), 2),
                )
            rows[name] = row
            extra = (f"; acceptance {accepted}/{drafts} = {row['acceptance_rate']:.2f}, "
                     f"{row['tokens_per_speculative_step']} tokens/step") if specs[name] else ""
            print(f"{workload} | {name}: identical {row['identical_tokens']}; decode tok/s wall {wall:.1f} "
                  f"({row['speedup_wall']:.2f}x), per CPU-second {cpu:.1f} "
                  f"({row['speedup_per_cpu_second']:.2f}x){extra}",
                  flush=True)
        results[workload] = rows
    load_after = os.getloadavg()
    report = {
        **stamp,
        "omp_num_threads": os.environ["OMP_NUM_THREADS"],
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "model": "default (SmolLM2-135M-Instruct GGUF Q4_1, loaded as float32; the self-draft loads it as wint4)",
        "batch": 1, "tokens": args.tokens, "rounds": args.rounds,
        "peer": "the same engine with speculation off, measured in the same run, rounds alternating",
        "workloads": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
        fh.write("\n")
    print(f"# load average after {load_after[0]:.1f} {load_after[1]:.1f}; wrote {args.out}")


if __name__ == "__main__":
    main()
