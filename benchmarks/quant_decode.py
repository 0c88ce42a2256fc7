"""Batch-1 decode speed and weight memory of the default model per quantization method.

Usage: python benchmarks/quant_decode.py [--methods none,wint8,wint4] [--tokens 64] [--rounds 3]
       (``wint4:fma`` / ``w4a8:fma``: int4 in the float-FMA kernel's layout, not the VNNI one;
       ``wint8:fma``: int8 in fd_int8_linear's float32 loop, not the integer-product quads)
       [--model PATH]

Builds one model per method (the native Llama with the method's quantizer, the cpu device's
ops table with the C++ kernels), prefills the SmolLM2 chat prompt and times ``--tokens``
greedy decode steps over a paged KV cache, each decode step replayed from its captured graph as
the engine does (``--eager``: the Python forward every step). Methods are measured round-robin in one process
so machine noise hits them alike; the best round per method is reported, with the ratio to
float32 ("none"). Besides wall-clock tok/s it reports the process CPU time per decode step:
with ``OMP_NUM_THREADS=1 FD_CPU_KERNEL_THREADS=1`` that is the work per token, a number a
busy shared machine does not distort (wall time there is mostly waiting for a core).
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def weight_bytes(model) -> int:
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        n = 1
        for d in tensor.shape:
            n *= int(d)
        total += n * tensor.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--methods", default="none,wint8,wint4")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--eager", action="store_true", help="no captured decode steps (the engine's --enforce-eager)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")

    import paddle

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [root, os.path.join(root, "plugins", "fd-llama")]
    from fd_llama.llama import LlamaForCausalLM

    from fastdeploy_core.builtin.cpu.device import CpuDevice
    from fastdeploy_core.devices.current import set_current_ops
    from fastdeploy_core.executor.decode_graph import DecodeGraphs
    from fastdeploy_core.loader import load_model_weights, resolve_model_source
    from fastdeploy_core.builtin.cpu.kernels import load_kernels
    from fastdeploy_core.quantization.registry import resolve_quantization
    from fastdeploy_core.tokenizer import load_tokenizer
    from fastdeploy_core.testing.paged_harness import build_meta

    ops = CpuDevice.make_ops()
    set_current_ops(ops)
    load_kernels()
    source = resolve_model_source(args.model)
    tokenizer = load_tokenizer(source)
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    )

    runs = {}
    from fastdeploy_core.builtin.cpu.ops import CpuOps

    vnni_default, quads_default = CpuOps.int4_vnni_layout, CpuOps.wint8_int_dot
    for method in args.methods.split(","):
        t0 = time.perf_counter()
        quantizer = None
        # "wint4:fma": int4 weights in the float-FMA kernel's layout instead of the VNNI one (A/B in one process)
        name, _, variant = method.partition(":")
        CpuOps.int4_vnni_layout = vnni_default and variant != "fma"
        CpuOps.wint8_int_dot = quads_default and variant != "fma"
        if method != "none":
            quantizer = resolve_quantization(
                name,
                device=CpuDevice,
                hf_config=source.hf_config,
                gguf_path=source.path if source.format == "gguf" else None,
            )
        model = LlamaForCausalLM(source.hf_config, quant_config=quantizer)
        model.eval()
        load_model_weights(model, source)
        num_layers, kv_heads, head_dim = model.kv_cache_spec()
        bs = 64
        blocks = -(-(len(prompt) + args.tokens + 1) // bs)
        caches = [
            (paddle.zeros([blocks, bs, kv_heads, head_dim]), paddle.zeros([blocks, bs, kv_heads, head_dim]))
            for _ in range(num_layers)
        ]
        CpuOps.int4_vnni_layout, CpuOps.wint8_int_dot = vnni_default, quads_default
        runs[method] = {
            "model": model,
            "caches": caches,
            "table": list(range(blocks)),
            # decode steps replayed as the engine does (one graph for batch 1), unless --eager
            "graphs": None if args.eager else DecodeGraphs(model, ops, caches, [1], blocks * bs, bs),
            "load_s": time.perf_counter() - t0,
            "weight_mib": weight_bytes(model) / 2**20,
            "decode": [],
            "prefill": [],
            "cpu_ms": [],
            "text": None,
        }

    def run(entry):
        model, caches, table = entry["model"], entry["caches"], entry["table"]

        graphs = entry["graphs"]

        def step(chunks):
            meta = build_meta(chunks, 64)
            if graphs is not None and meta.is_decode_only:
                for name in ("input_ids", "positions", "slot_mapping"):
                    setattr(meta, name, getattr(meta, name).numpy())
                hidden = graphs.run(meta)  # [1, H]: the decode row is the last row
            else:
                hidden = paddle.index_select(model(meta, caches), meta.logits_indices, axis=0)
            return ops.argmax_rows(model.compute_logits(hidden))

        t = time.perf_counter()
        tokens = step([(prompt, 0, table)])
        prefill = time.perf_counter() - t
        out = [int(tokens[0])]
        t, cpu = time.perf_counter(), time.process_time()
        for i in range(args.tokens):
            tokens = step([([out[-1]], len(prompt) + i, table)])
            out.append(int(tokens[0]))
        entry["cpu_ms"].append((time.process_time() - cpu) / args.tokens * 1e3)
        return prefill, args.tokens / (time.perf_counter() - t), out

    with paddle.no_grad():
        for entry in runs.values():
            run(entry)  # warm-up
        for _ in range(args.rounds):
            for entry in runs.values():
                prefill, tok_s, out = run(entry)
                entry["prefill"].append(prefill)
                entry["decode"].append(tok_s)
                entry["text"] = tokenizer.decode(out)

    base = max(runs["none"]["decode"]) if "none" in runs else None
    base_cpu = min(runs["none"]["cpu_ms"]) if "none" in runs else None
    results = {}
    print(
        f"threads: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} FD_CPU_KERNEL_THREADS={os.environ.get('FD_CPU_KERNEL_THREADS', '-')}"
    )
    print(
        f"{'method':<16}{'weights MiB':>12}{'prefill ms':>12}{'decode tok/s':>14}{'vs fp32':>9}{'CPU ms/tok':>12}{'vs fp32':>9}  first tokens"
    )
    for method, entry in runs.items():
        best = max(entry["decode"])
        results[method] = {
            "weight_mib": round(entry["weight_mib"], 1),
            "prefill_ms": round(min(entry["prefill"]) * 1e3, 1),
            "decode_tok_s": round(best, 1),
            "decode_runs": [round(x, 1) for x in entry["decode"]],
            "vs_float32": round(best / base, 2) if base else None,
            "cpu_ms_per_token": round(min(entry["cpu_ms"]), 2),
            "cpu_vs_float32": round(base_cpu / min(entry["cpu_ms"]), 2) if base_cpu else None,
            "text": entry["text"][:60],
        }
        r = results[method]
        print(
            f"{method:<16}{r['weight_mib']:>12}{r['prefill_ms']:>12}{r['decode_tok_s']:>14}{r['vs_float32']!s:>9}"
            f"{r['cpu_ms_per_token']:>12}{r['cpu_vs_float32']!s:>9}  {r['text']!r}"
        )
    if args.json:
        from run_stamp import run_stamp

        threads = {"omp": os.environ["OMP_NUM_THREADS"], "kernel_pool": os.environ.get("FD_CPU_KERNEL_THREADS")}
        with open(args.json, "w") as fh:
            json.dump({**run_stamp(), "threads": threads, "eager": args.eager, "methods": results}, fh, indent=1)


if __name__ == "__main__":
    main()
