"""``fastdeploy bench serve``: load-test any OpenAI-compatible server (ours or a peer).

Prompts are generated locally (no downloads): ``random`` draws words from a fixed list to a
target length; ``sharegpt`` imitates ShareGPT's shape (a question with a context paragraph,
input and output lengths drawn from long-tailed distributions). Every request streams, so the
client sees each token's arrival: TTFT (time to first token), ITL (gap between tokens), TPOT
(per output token after the first) and E2EL (end-to-end latency) are reported as mean,
median and p99, with request and output-token throughput. ``--result-file`` writes JSON,
``--plot-file`` a PNG (matplotlib).

Flags follow FastDeploy's / vLLM's ``benchmark_serving.py``: ``--base-url``, ``--backend``,
``--model``, ``--dataset-name``, ``--num-prompts``, ``--max-concurrency``, ``--request-rate``,
``--random-input-len``, ``--random-output-len``, ``--seed``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import typer

from fastdeploy_core.cli.progress import progress_bar

_WORDS = ["time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school", "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week", "company", "system", "program", "question", "work", "government", "number", "night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game", "line", "end", "member", "law", "car", "city", "community", "name", "president", "team", "minute", "idea", "kid", "body", "information", "back", "parent", "face", "others", "level", "office", "door", "health", "person", "art", "war", "history", "party", "result", "change", "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force", "education", "river", "mountain", "garden", "window", "music", "market", "energy", "light", "paper", "table", "science", "language", "animal"]

_QUESTIONS = (
    "Summarize the following notes in a few sentences.",
    "Explain what the text below is about to a child.",
    "Write a short story that continues this passage.",
    "List the main ideas of the paragraph below.",
    "Translate the meaning of this text into plain words.",
    "What questions would you ask the author of this text?",
)


@dataclass
class BenchRequest:
    prompt: str
    approx_input_words: int
    output_len: int


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def make_requests(dataset: str, num: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Locally generated prompts; the same seed gives the same prompts for every server."""
    rng = random.Random(seed)
    out: list[BenchRequest] = []
    for _ in range(num):
        if dataset == "random":
            n_in, n_out = input_len, output_len
            text = " ".join(rng.choice(_WORDS) for _ in range(n_in))
        elif dataset == "sharegpt":
            # ShareGPT-like long tails: median ~ input_len / output_len, clipped.
            n_in = int(min(max(4, rng.lognormvariate(math.log(input_len), 0.6)), input_len * 4))
            n_out = int(min(max(4, rng.lognormvariate(math.log(output_len), 0.5)), output_len * 3))
            text = rng.choice(_QUESTIONS) + "\n\n" + " ".join(rng.choice(_WORDS) for _ in range(n_in))
        else:
            raise typer.BadParameter(f"unknown dataset {dataset!r}; use random or sharegpt", param_hint="--dataset-name")
        out.append(BenchRequest(text, n_in, n_out))
    return out


async def _one(client, url: str, backend: str, model: str, req: BenchRequest, headers: dict) -> RequestResult:
    body: dict = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}, "ignore_eos": True}
    if backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    result = RequestResult(ok=False)
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    result.error = str(payload["error"])[:200]
                    return result
                usage = payload.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                for choice in payload.get("choices") or []:
                    piece = choice.get("text")
                    if piece is None:
                        piece = (choice.get("delta") or {}).get("content")
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
        result.e2el = time.perf_counter() - start
        if not result.output_tokens:
            result.output_tokens = chunks  # servers without usage in streams: one token per chunk
        result.ok = last is not None
        if not result.ok:
            result.error = "no tokens received"
    except Exception as exc:  # noqa: BLE001 - counted as a failed request
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    s = sorted(values)
    p99 = s[min(len(s) - 1, max(0, math.ceil(0.99 * len(s)) - 1))]
    return {"mean": statistics.fmean(s) * scale, "median": statistics.median(s) * scale, "p99": p99 * scale}


async def run_benchmark(
    base_url: str,
    backend: str,
    model: str | None,
    requests: list[BenchRequest],
    max_concurrency: int | None,
    request_rate: float,
    api_key: str | None,
    seed: int = 0,
    timeout: float = 1800.0,
    transport=None,
    progress=None,
) -> dict:
    """Send ``requests`` at ``request_rate`` (Poisson; inf = all at once) with at most
    ``max_concurrency`` in flight; return the summary (times in ms, the 1/5/15-minute load
    averages of this machine before and after: on a shared machine they say what the figures
    are worth). ``transport`` is an httpx transport (tests); ``progress`` (a tqdm bar) advances
    as each request finishes."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    path = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    limits = httpx.Limits(max_connections=max(1, max_concurrency or len(requests)) + 4)
    load_before = _load_average()
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits, transport=transport) as client:
        if model is None:
            models = (await client.get("/v1/models", headers=headers)).json()
            model = models["data"][0]["id"]
        sem = asyncio.Semaphore(max_concurrency or len(requests) or 1)
        rng = random.Random(seed)

        async def limited(req: BenchRequest) -> RequestResult:
            async with sem:
                result = await _one(client, path, backend, model, req, headers)
            if progress is not None:
                progress.update(1)
            return result

        tasks = []
        start = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(limited(req)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "base_url": base_url,
        "backend": backend,
        "model": model,
        "num_prompts": len(requests),
        "max_concurrency": max_concurrency,
        "request_rate": request_rate if request_rate != float("inf") else "inf",
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "load_before": load_before,
        "load_after": _load_average(),
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.e2el for r in ok]),
        "per_request": [
            {k: v for k, v in asdict(r).items() if k != "itl"} | {"itl_mean": statistics.fmean(r.itl) if r.itl else 0.0}
            for r in results
        ],
    }
    return summary


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


def format_summary(s: dict) -> str:
    lines = [
        f"{'Successful requests':<32}{s['completed']}",
        f"{'Failed requests':<32}{s['failed']}",
        f"{'Benchmark duration (s)':<32}{s['duration_s']:.2f}",
        f"{'Total output tokens':<32}{s['total_output_tokens']}",
        f"{'Request throughput (req/s)':<32}{s['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s)':<32}{s['output_throughput']:.2f}",
    ]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL")):
        st = s[key]
        lines.append(f"{label + ' mean/median/p99 (ms)':<32}{st['mean']:.1f} / {st['median']:.1f} / {st['p99']:.1f}")
    if s.get("load_before") and s.get("load_after"):
        lines.append(f"{'Load average 1/5/15 min':<32}{s['load_before']} before, {s['load_after']} after")
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    return "\n".join(lines)


def plot_summaries(summaries: list[tuple[str, dict]], path: str) -> None:
    """Bar charts of throughput and latency for one or more labelled runs."""
    import logging

    # matplotlib logs "generated new fontManager" at INFO the first time it runs on a machine:
    # nothing the user asked about, and the report above would end with it.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot-file needs matplotlib: pip install 'fastdeploy-core[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, _ in summaries]
    fig, axes = plt.subplots(1, 5, figsize=(22, 4.5))
    metrics = [("output_throughput", "output tok/s", None), ("ttft_ms", "TTFT ms", "median"),
               ("tpot_ms", "TPOT ms", "median"), ("itl_ms", "ITL ms", "median"), ("e2el_ms", "E2EL ms", "median")]
    for ax, (key, title, sub) in zip(axes, metrics):
        if sub is None:
            values = [s[key] for _, s in summaries]
            ax.bar(range(len(labels)), values, color="tab:blue")
        else:
            med = [s[key]["median"] for _, s in summaries]
            p99 = [s[key]["p99"] for _, s in summaries]
            x = range(len(labels))
            ax.bar([i - 0.2 for i in x], med, width=0.4, label="median")
            ax.bar([i + 0.2 for i in x], p99, width=0.4, label="p99")
            ax.legend(fontsize=7)
        ax.set_title(title)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_serve_command(
    base_url: str = typer.Option("http://127.0.0.1:8000", "--base-url", help="Server root (without /v1)."),
    backend: str = typer.Option("openai", "--backend", help="openai (/v1/completions) or openai-chat (/v1/chat/completions)."),
    model: str | None = typer.Option(None, "--model", help="Model name to send (default: the first of /v1/models)."),
    dataset_name: str = typer.Option("random", "--dataset-name", help="random | sharegpt (both generated locally)."),
    num_prompts: int = typer.Option(100, "--num-prompts", min=1),
    max_concurrency: int | None = typer.Option(None, "--max-concurrency", min=1, help="Requests in flight at most (default: all)."),
    request_rate: float = typer.Option(float("inf"), "--request-rate", help="Requests per second (Poisson); inf sends all at once."),
    random_input_len: int = typer.Option(128, "--random-input-len", min=1, help="Words per prompt (random) or median (sharegpt)."),
    random_output_len: int = typer.Option(64, "--random-output-len", min=1, help="max_tokens per request (median for sharegpt)."),
    seed: int = typer.Option(0, "--seed"),
    api_key: str | None = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY"),
    result_file: str | None = typer.Option(None, "--result-file", help="Write the summary as JSON here."),
    plot_file: str | None = typer.Option(None, "--plot-file", help="Write a PNG plot here."),
    label: str | None = typer.Option(None, "--label", help="Name of this run in the JSON and plot."),
) -> None:
    """Benchmark an OpenAI-compatible server: throughput and TTFT/TPOT/ITL/E2EL."""
    if backend not in ("openai", "openai-chat"):
        raise typer.BadParameter("use openai or openai-chat", param_hint="--backend")
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the report
    reqs = make_requests(dataset_name, num_prompts, random_input_len, random_output_len, seed)
    with progress_bar(len(reqs), f"{base_url}", "requests") as bar:
        summary = asyncio.run(
            run_benchmark(base_url, backend, model, reqs, max_concurrency, request_rate, api_key, seed, progress=bar)
        )
    summary["label"] = label or base_url
    summary["dataset_name"] = dataset_name
    typer.echo(format_summary(summary))
    if result_file:
        os.makedirs(os.path.dirname(os.path.abspath(result_file)), exist_ok=True)
        with open(result_file, "w") as f:
            json.dump(summary, f, indent=2)
    if plot_file:
        try:
            plot_summaries([(summary["label"], summary)], plot_file)
        except ImportError:
            typer.echo("note: no PNG written; `pip install matplotlib` for --plot-file", err=True)


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the ``fastdeploy bench`` group (created by ``fastdeploy_core.cli.bench``)."""
    from fastdeploy_core.cli.bench import bench_app

    bench_app.command("serve", help="Load-test an OpenAI-compatible server (ours or a peer).")(bench_serve_command)
