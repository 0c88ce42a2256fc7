"""Structured output: grammar compile times for a set of JSON schemas, and the decode cost of
token masks at batch 1 and 16 (constrained against unconstrained, same engine, same run).

    .venv/bin/python benchmarks/structured_output.py [--tokens 48] [--rounds 1]

Compile: the ``guidance`` backend (llguidance) is built once for the default model's
vocabulary, then each schema below is compiled (wall and CPU milliseconds) and its first
bitmask filled, as the engine's compile worker does for a request's first step.

Masking: one engine (max_num_seqs 16) decodes ``--tokens`` tokens per request, greedily, for a
batch of 1 and of 16 requests, unconstrained (``ignore_eos``) and constrained to a JSON array
of at least 60 strings (so no constrained reply can end before ``--tokens``), alternating
in each round so a change in the machine's load hits both alike. Decode tokens per second by
wall clock and per CPU-second of this process; the time to the first token (the prompt step)
is left out. The machine may be shared with other work: the load average is printed.
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

ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
           "required": ["street", "city"]}
#: Shapes that real clients send: extraction, function arguments, configs, API payloads.
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
               "maximum": 150}, "email": {"type": "string", "format": "email"}}, "required": ["name", "age"]},
    "address_ref": {"$defs": {"address": ADDRESS}, "type": "object",
                    "properties": {"home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}},
                    "required": ["home"]},
    "weather_call": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                     "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1,
                                                                            "maximum": 14}},
                     "required": ["city", "unit"], "additionalProperties": False},
    "invoice": {"type": "object", "properties": {
        "number": {"type": "string", "pattern": "^INV-[0-9]{6}$"}, "currency": {"enum": ["EUR", "USD", "CNY"]},
        "lines": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
            "price": {"type": "number", "minimum": 0}}, "required": ["sku", "qty", "price"]}},
        "total": {"type": "number"}}, "required": ["number", "currency", "lines", "total"]},
    "sentiment": {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                  "score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["label", "score"]},
    "calendar_event": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 80}, "start": {"type": "string", "format": "date-time"},
        "end": {"type": "string", "format": "date-time"}, "attendees": {"type": "array", "items": {
            "type": "string", "format": "email"}, "maxItems": 20}, "recurring": {"type": "boolean"}},
        "required": ["title", "start"]},
    "product_catalog": {"type": "array", "maxItems": 10, "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "in_stock": {"type": "boolean"}, "rating": {"type": ["number", "null"]}}, "required": ["id", "name"]}},
    "github_issue": {"type": "object", "properties": {
        "title": {"type": "string"}, "body": {"type": "string"},
        "labels": {"type": "array", "items": {"enum": ["bug", "enhancement", "docs", "question"]}},
        "assignee": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "priority": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["title", "labels"]},
    "k8s_container": {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9-]{1,63}$"}, "image": {"type": "string"},
        "ports": {"type": "array", "items": {"type": "object", "properties": {
            "containerPort": {"type": "integer", "minimum": 1, "maximum": 65535},
            "protocol": {"enum": ["TCP", "UDP"]}}, "required": ["containerPort"]}},
        "env": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"},
                                                                            "value": {"type": "string"}},
                                           "required": ["name", "value"]}},
        "resources": {"type": "object", "properties": {"limits": {"type": "object", "additionalProperties": {
            "type": "string"}}}}}, "required": ["name", "image"]},
    "tree_recursive": {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["value"]}}, "$ref": "#/$defs/node"},
}
#: The masking workload: a reply that cannot be complete before 60 strings.
LONG_ARRAY = {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 60}
PROMPT = [{"role": "user", "content": "List many fruits and vegetables, one per line."}]


def compile_times(llm) -> tuple[float, list[tuple[str, float, float, float]]]:
    """(backend build seconds, [(name, compile wall ms, compile CPU ms, first mask ms)])."""
    import numpy as np

    from fastdeploy_core.guided.backend import bitmask_words
    from fastdeploy_core.guided.llguidance_backend import LLGuidanceBackend
    from fastdeploy_core.guided.params import GuidedDecodingParams

    core = llm.engine.core
    t0 = time.perf_counter()
    backend = LLGuidanceBackend(llm.engine.tokenizer, core.vocab_size, core.eos_token_ids)
    build = time.perf_counter() - t0
    row = np.zeros(bitmask_words(core.vocab_size), dtype=np.int32)
    rows = []
    for name, schema in SCHEMAS.items():
        params = GuidedDecodingParams(json=schema)
        w0, c0 = time.perf_counter(), time.process_time()
        grammar = backend.compile(params)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        m0 = time.perf_counter()
        grammar.matcher().fill_bitmask(row)
        rows.append((name, wall * 1e3, cpu * 1e3, (time.perf_counter() - m0) * 1e3))
    return build, rows


def decode_batch(llm, batch: int, tokens: int, constrained: bool) -> dict:
    """Decode ``batch`` requests together; tokens per second after the first token."""
    from fastdeploy_core import SamplingParams
    from fastdeploy_core.engine.outputs import EngineCoreRequest
    from fastdeploy_core.guided.params import GuidedDecodingParams

    core = llm.engine.core
    text = llm.engine.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
    prompt = list(llm.engine.tokenizer.encode(text, add_special_tokens=False))
    for i in range(batch):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=not constrained,
                                guided_decoding=GuidedDecodingParams(json=LONG_ARRAY) if constrained else None)
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
    first_wall = first_cpu = None
    counted = 0
    while core.has_unfinished_requests():
        outs = core.step()
        if first_wall is None and len(outs) == batch:  # every request has its first token
            first_wall, first_cpu = time.perf_counter(), time.process_time()
            continue
        if first_wall is not None:
            counted += sum(len(o.new_token_ids) for o in outs)
    wall, cpu = time.perf_counter() - first_wall, time.process_time() - first_cpu
    return {"tokens": counted, "wall_tps": counted / wall, "cpu_tps": counted / cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()

    from run_stamp import run_stamp

    from fastdeploy_core import LLM

    llm = LLM(max_model_len=1024, num_gpu_blocks_override=256, max_num_seqs=16)
    stamp = run_stamp()
    load = os.getloadavg()
    print(f"# structured output, default model, guidance backend, {args.tokens} tokens, {args.rounds} rounds")
    print(f"# {stamp['date']}, {stamp['cpu_model']}, {stamp['cpus']} cpus, OMP_NUM_THREADS="
          f"{os.environ['OMP_NUM_THREADS']}, load average {load[0]:.1f} {load[1]:.1f} (shared machine)")
    build, rows = compile_times(llm)
    print(f"backend build (vocabulary view) {build * 1e3:.0f} ms")
    for name, wall, cpu, mask in rows:
        print(f"compile {name:16s} wall {wall:7.1f} ms  cpu {cpu:7.1f} ms  first mask {mask:5.2f} ms")
    walls = [r[1] for r in rows]
    print(f"compile median {statistics.median(walls):.1f} ms, max {max(walls):.1f} ms over {len(rows)} schemas")
    decode_batch(llm, 1, 4, constrained=True)  # warm-up: the long-array grammar compiled and cached
    decode_batch(llm, 1, 4, constrained=False)
    for batch in (1, 16):
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.rounds):
            for constrained in (False, True):
                runs[constrained].append(decode_batch(llm, batch, args.tokens, constrained))
        off_w = statistics.median(r["wall_tps"] for r in runs[False])
        on_w = statistics.median(r["wall_tps"] for r in runs[True])
        off_c = statistics.median(r["cpu_tps"] for r in runs[False])
        on_c = statistics.median(r["cpu_tps"] for r in runs[True])
        print(f"batch {batch:2d}: decode tok/s wall unconstrained {off_w:.1f} constrained {on_w:.1f} "
              f"(overhead {100 * (1 - on_w / off_w):+.1f}%); per CPU-second {off_c:.1f} / {on_c:.1f} "
              f"(overhead {100 * (1 - on_c / off_c):+.1f}%)")
    load = os.getloadavg()
    print(f"# load average at the end {load[0]:.1f} {load[1]:.1f}")


if __name__ == "__main__":
    main()
