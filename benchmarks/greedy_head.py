"""The greedy LM head (``fd_greedy_head``) on the default model: head time and recomputed tiles.

    .venv/bin/python benchmarks/greedy_head.py [--steps 24] [--iters 30]

1. Real decodes: 16 chat prompts decoded greedily together (``--steps`` tokens each) through
   the engine, recording the hidden states the runner hands to ``compute_greedy_tokens``.
2. Head time on those hidden states, batch 1, 16 and 64 (rows drawn from the recording):
   full = ``argmax_rows(linear(h, W))`` (``fd_f32_linear`` + ``fd_argmax``, what a greedy step
   ran before), fast = ``greedy_lm_head`` (``fd_greedy_head``). Medians of ``--iters`` calls.
3. Recomputed 32-column tiles per row on every recorded row (1536 = the whole row).
4. Engine decode steps, batch 1 / 16 / 64, with and without the greedy head, two runs each,
   alternating (wall ms per step, medians; the machine is shared, so compare within one run),
   on chat prompts and on random-token prompts (quick_bench's workload: its continuations are
   flat distributions, where many rows recompute their whole row and the head gains little).
Prints one block of text for benchmarks/greedy_head.md, with the machine load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "plugins", "fd-llama")]

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a CPU cache works.",
    "List three prime numbers and explain why they are prime.",
    "Give me a recipe for pancakes.",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish and German.",
    "Summarize the plot of Romeo and Juliet.",
    "How do I reverse a list in Python?",
    "What is photosynthesis?",
    "Tell me a joke about computers.",
    "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.",
    "What are the benefits of exercise?",
    "How does a bicycle stay upright?",
    "Write a haiku about autumn.",
]


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f}"


def _median_ms(fn, iters: int) -> tuple[float, float]:
    """Median wall and process CPU ms of ``fn()`` (CPU time: all threads; with
    FD_CPU_KERNEL_THREADS=1 the work per call, which the machine's load distorts less)."""
    fn()
    walls, cpus = [], []
    for _ in range(iters):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return 1e3 * statistics.median(walls), 1e3 * statistics.median(cpus)


def record_hidden(llm, steps: int):
    """Hidden rows of real greedy decodes (every step's rows, as the runner passes them)."""
    from fastdeploy_core import SamplingParams

    model = llm.engine.core.runner.model
    rows = []
    original = model.compute_greedy_tokens

    def recording(hidden):
        rows.append(hidden.numpy())
        return original(hidden)

    model.compute_greedy_tokens = recording
    try:
        messages = [[{"role": "user", "content": p}] for p in PROMPTS]
        outs = llm.chat(messages, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    finally:
        del model.compute_greedy_tokens
    import numpy as np

    return np.concatenate(rows, axis=0), [o.outputs[0].text for o in outs]


def chat_prompts(llm, batch: int) -> list[list[int]]:
    """``batch`` chat prompts (PROMPTS, repeated with a numbered suffix) as token ids."""
    tok = llm.engine.tokenizer
    texts = [f"{PROMPTS[i % len(PROMPTS)]} ({i // len(PROMPTS) + 1})" for i in range(batch)]
    return [list(tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))) for t in texts]


def engine_steps(llm, batch: int, tokens: int, greedy_head: bool, random_tokens: bool) -> float:
    """Median wall ms of the decode steps of ``batch`` requests (after every prompt is in):
    chat prompts, or prompts of random token ids (quick_bench's workload)."""
    from fastdeploy_core import SamplingParams
    from fastdeploy_core.cli.bench import random_prompts

    engine = llm.engine
    model = engine.core.runner.model
    if not greedy_head:
        model.compute_greedy_tokens = None
    try:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        prompts = (
            random_prompts(batch, 16, engine.core.vocab_size, seed=batch) if random_tokens else chat_prompts(llm, batch)
        )
        for prompt in prompts:
            engine.add_request(prompt, params)
        times, decoding = [], False
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            outs = engine.step()
            elapsed = time.perf_counter() - t
            if decoding:
                times.append(elapsed)
            decoding = decoding or (len(outs) == batch and all(o.outputs[0].token_ids for o in outs))
    finally:
        if not greedy_head:
            del model.compute_greedy_tokens
    return 1e3 * statistics.median(times[:-1] or times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="tokens per prompt in the recorded decodes")
    parser.add_argument("--iters", type=int, default=30, help="head calls per timing")
    parser.add_argument("--engine-tokens", type=int, default=12, help="tokens per request in the engine comparison")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine decode-step comparison")
    args = parser.parse_args()

    import numpy as np
    import paddle
    from paddle import _C_ops

    from fastdeploy_core import LLM
    from fastdeploy_core.devices.current import current_ops

    print(_load())
    llm = LLM(
        max_model_len=512, num_gpu_blocks_override=64 * 512 // 64 + 16, max_num_seqs=64, enable_prefix_caching=False
    )
    head = llm.engine.core.runner.model.lm_head
    ops = current_ops()
    if head.greedy_state is None:
        sys.exit("the head has no greedy state: kernels missing, no AVX-512 VNNI, or FD_GREEDY_HEAD=0")
    hidden, texts = record_hidden(llm, args.steps)
    print(f"recorded {hidden.shape[0]} hidden rows from {len(PROMPTS)} chat decodes; e.g. {texts[0][:60]!r}")

    weight, state = head.weight, head.greedy_state
    rng = np.random.default_rng(0)
    threads = os.environ.get("FD_CPU_KERNEL_THREADS") or os.environ.get("OMP_NUM_THREADS")
    print(f"\nhead, ms (medians; kernel threads {threads}):  full (fd_f32_linear + fd_argmax)  fast (fd_greedy_head)")
    for batch in (1, 16, 64):
        h = paddle.to_tensor(np.ascontiguousarray(hidden[rng.choice(hidden.shape[0], batch, replace=False)]))
        assert ops.greedy_lm_head(h, weight, None, state).tolist() == ops.argmax_rows(ops.linear(h, weight)).tolist()
        full = _median_ms(lambda h=h: ops.argmax_rows(ops.linear(h, weight)), args.iters)
        fast = _median_ms(lambda h=h: ops.greedy_lm_head(h, weight, None, state), args.iters)
        print(
            f"  batch {batch:2d}: wall {full[0]:6.2f} -> {fast[0]:6.2f} ({full[0] / fast[0]:.1f}x), "
            f"cpu {full[1]:6.2f} -> {fast[1]:6.2f} ({full[1] / fast[1]:.1f}x)   [{_load()}]"
        )

    _, tiles = _C_ops._run_custom_op("fd_greedy_head", paddle.to_tensor(hidden), weight, *state)
    tiles = tiles.numpy()
    total = int(weight.shape[0])
    print(
        f"\nrecomputed tiles per row (of {total}; one tile = 32 vocabulary entries), {tiles.size} rows: "
        f"median {np.median(tiles):.0f}, mean {tiles.mean():.1f}, p90 {np.percentile(tiles, 90):.0f}, "
        f"max {tiles.max()}, whole-row fallbacks {(tiles == total).sum()}"
    )

    if args.no_engine:
        return
    for random_tokens in (False, True):
        what = "random-token prompts" if random_tokens else "chat prompts"
        print(
            f"\nengine decode steps, {what}, wall ms (medians of two alternating runs each): logits path -> greedy head"
        )
        for batch in (1, 16, 64):
            runs = []
            for _ in range(2):
                runs.append(engine_steps(llm, batch, args.engine_tokens, False, random_tokens))
                runs.append(engine_steps(llm, batch, args.engine_tokens, True, random_tokens))
            print(
                f"  batch {batch:2d}: {runs[0]:7.2f} -> {runs[1]:7.2f}  |  {runs[2]:7.2f} -> {runs[3]:7.2f}   [{_load()}]"
            )


if __name__ == "__main__":
    main()
