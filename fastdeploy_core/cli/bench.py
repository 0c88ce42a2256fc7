"""``fastdeploy bench latency`` and ``fastdeploy bench throughput``: offline engine benchmarks.

Flags follow FastDeploy's / vLLM's offline benchmarks (``--input-len``, ``--output-len``,
``--batch-size``, ``--num-iters-warmup``, ``--num-iters``, ``--num-prompts``,
``--dataset-name random``, ``--output-json``); engine flags of ``fastdeploy serve`` pass
through. Prompts are random token ids (:func:`random_prompts`, seeded, so other stacks can
be measured on the very same prompts) and generation ignores eos, so every run produces
exactly ``output_len`` tokens per request.

``latency`` splits each iteration into prefill (until every request has its first token) and
decode (the rest) and reports prefill tok/s and decode tok/s at the given batch size.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import typer

from fastdeploy_core.cli.generate import _PASS_THROUGH, ENGINE_FLAGS_HELP, engine_args_from_extra
from fastdeploy_core.cli.progress import progress_bar
from fastdeploy_core.errors import FastDeployError

bench_app = typer.Typer(
    help="Offline engine benchmarks (latency, throughput).", no_args_is_help=True, rich_markup_mode=None
)

#: Token ids below this are left out of random prompts (control tokens of most vocabularies).
_FIRST_PLAIN_TOKEN = 100


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``input_len`` random ordinary token ids (same seed, same prompts)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    high = max(_FIRST_PLAIN_TOKEN + 1, vocab_size - _FIRST_PLAIN_TOKEN)
    return rng.integers(_FIRST_PLAIN_TOKEN, high, size=(num, input_len)).tolist()


def measure_iteration(engine, prompts: list[list[int]], output_len: int, progress=None) -> dict:
    """Run ``prompts`` to ``output_len`` tokens each; prefill and decode times in seconds.

    ``progress`` (a tqdm bar) advances by the tokens each step generated."""
    from fastdeploy_core.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    waiting_first = set()
    start = time.perf_counter()
    for prompt in prompts:
        waiting_first.add(engine.add_request(prompt, params))
    first_done = None
    steps = 0
    while engine.has_unfinished_requests():
        generated = 0
        for out in engine.step():
            if out.outputs[0].token_ids:
                waiting_first.discard(out.request_id)
                generated += len(out.outputs[0].delta_token_ids)  # several when drafts were accepted
        if progress is not None:
            progress.update(generated)
        steps += 1
        if first_done is None and not waiting_first:
            first_done = time.perf_counter()
    end = time.perf_counter()
    first_done = first_done or end
    batch = len(prompts)
    prefill = first_done - start
    decode = end - first_done
    return {
        "latency_s": end - start,
        "prefill_s": prefill,
        "decode_s": decode,
        "prefill_tok_s": batch * len(prompts[0]) / prefill if prefill > 0 else 0.0,
        "decode_tok_s": batch * (output_len - 1) / decode if decode > 0 and output_len > 1 else 0.0,
        "steps": steps,
    }


def _engine(ctx: typer.Context):
    from fastdeploy_core.engine.llm_engine import LLMEngine

    return LLMEngine(engine_args_from_extra(ctx.args))


def machine_load() -> dict:
    """Load average and CPU count: a busy machine makes every number here smaller."""
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return {}
    return {"load_avg_1m": one, "load_avg_5m": five, "cpu_count": os.cpu_count()}


def _warn_if_busy(load: dict) -> None:
    if load and load["load_avg_1m"] > (load["cpu_count"] or 1):
        typer.echo(
            f"note: load average {load['load_avg_1m']:.1f} on {load['cpu_count']} CPUs during the run; "
            "other work shared the cores, so these speeds are lower than the engine's",
            err=True,
        )


def speculation_summary(engine) -> dict:
    """The engine's speculative-decoding counters over the whole run (empty when it is off)."""
    return engine.core.speculative_stats()


def speculation_line(stats: dict) -> str | None:
    """One line on what speculation did, or None when it was off."""
    if not stats:
        return None
    return (
        f"Speculative decoding ({stats['spec_decode_method']}): "
        f"{stats['spec_decode_num_draft_tokens_total']} draft tokens proposed, "
        f"{stats['spec_decode_num_accepted_tokens_total']} accepted "
        f"(acceptance rate {stats['spec_decode_draft_acceptance_rate']:.1%}); "
        f"mean accepted length {stats['spec_decode_mean_accepted_length']:.2f} tokens per speculating step"
    )


def _report_speculation(engine, summary: dict) -> None:
    stats = speculation_summary(engine)
    line = speculation_line(stats)
    if line:
        summary["speculative_decoding"] = stats
        typer.echo(line)


def _write_json(path: str | None, data: dict) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)


@bench_app.command(
    "latency",
    context_settings=_PASS_THROUGH,
    help="Latency of one batch: prefill and decode speed. " + ENGINE_FLAGS_HELP,
)
def latency_command(
    ctx: typer.Context,
    input_len: int = typer.Option(32, "--input-len", help="Prompt tokens per request."),
    output_len: int = typer.Option(128, "--output-len", help="Generated tokens per request."),
    batch_size: int = typer.Option(8, "--batch-size", help="Requests run together."),
    num_iters_warmup: int = typer.Option(1, "--num-iters-warmup", help="Untimed iterations first."),
    num_iters: int = typer.Option(3, "--num-iters", help="Timed iterations."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random prompts."),
    output_json: str | None = typer.Option(None, "--output-json", help="Also write the results here."),
) -> None:
    try:
        engine = _engine(ctx)
    except FastDeployError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None
    vocab = engine.core.vocab_size
    runs = []
    iters = num_iters_warmup + num_iters
    bar = progress_bar(iters * batch_size * output_len, f"{iters} iterations", "tokens")
    for i in range(iters):
        prompts = random_prompts(batch_size, input_len, vocab, seed=seed + i)
        result = measure_iteration(engine, prompts, output_len, bar)
        if i >= num_iters_warmup:
            runs.append(result)
            bar.write(
                f"iter {i - num_iters_warmup}: {result['latency_s']:.3f} s  prefill {result['prefill_tok_s']:.1f} tok/s  "
                f"decode {result['decode_tok_s']:.1f} tok/s",
                file=sys.stdout,
            )
    bar.close()
    summary = {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "avg_latency": statistics.mean(r["latency_s"] for r in runs),
        "latencies": [r["latency_s"] for r in runs],
        "avg_prefill_s": statistics.mean(r["prefill_s"] for r in runs),
        "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "engine": engine.core.config_info(),
        "machine": machine_load(),
    }
    _warn_if_busy(summary["machine"])
    typer.echo(
        f"Avg latency: {summary['avg_latency']:.3f} s (batch {batch_size}, {input_len} in, {output_len} out); "
        f"prefill {summary['prefill_tok_s']:.1f} tok/s; decode {summary['decode_tok_s']:.1f} tok/s"
    )
    _report_speculation(engine, summary)
    _write_json(output_json, summary)


@bench_app.command(
    "throughput", context_settings=_PASS_THROUGH, help="Offline throughput of many requests. " + ENGINE_FLAGS_HELP
)
def throughput_command(
    ctx: typer.Context,
    input_len: int = typer.Option(32, "--input-len", help="Prompt tokens per request."),
    output_len: int = typer.Option(128, "--output-len", help="Generated tokens per request."),
    num_prompts: int = typer.Option(64, "--num-prompts", help="Requests submitted at once."),
    dataset_name: str = typer.Option("random", "--dataset-name", help="Only `random` (random token ids)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random prompts."),
    output_json: str | None = typer.Option(None, "--output-json", help="Also write the results here."),
) -> None:
    if dataset_name != "random":
        typer.echo(f"error: --dataset-name {dataset_name!r} is not supported; use random", err=True)
        raise typer.Exit(2)
    try:
        engine = _engine(ctx)
    except FastDeployError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None
    measure_iteration(engine, random_prompts(1, input_len, engine.core.vocab_size, seed=seed + 10_000), 4)  # warm-up
    prompts = random_prompts(num_prompts, input_len, engine.core.vocab_size, seed=seed)
    with progress_bar(num_prompts * output_len, f"{num_prompts} requests", "tokens") as bar:
        result = measure_iteration(engine, prompts, output_len, bar)
    elapsed = result["latency_s"]
    summary = {
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "elapsed_time": elapsed,
        "requests_per_second": num_prompts / elapsed,
        "total_tokens_per_second": num_prompts * (input_len + output_len) / elapsed,
        "output_tokens_per_second": num_prompts * output_len / elapsed,
        "engine": engine.core.config_info(),
        "machine": machine_load(),
    }
    _warn_if_busy(summary["machine"])
    typer.echo(
        f"Throughput: {summary['requests_per_second']:.2f} requests/s, {summary['total_tokens_per_second']:.1f} total tokens/s, "
        f"{summary['output_tokens_per_second']:.1f} output tokens/s ({num_prompts} x {input_len} in / {output_len} out, "
        f"{elapsed:.2f} s)"
    )
    _report_speculation(engine, summary)
    _write_json(output_json, summary)


def register(app: typer.Typer) -> None:
    """Add ``bench latency`` and ``bench throughput`` to the ``fastdeploy`` command line."""
    app.add_typer(bench_app, name="bench")
