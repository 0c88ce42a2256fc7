"""Progress of the long commands: a bar with an ETA on a terminal's stderr, nothing otherwise;
and no stray log line from matplotlib when ``bench serve`` plots."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
from types import SimpleNamespace

import httpx

from fastdeploy_core.cli import progress
from fastdeploy_core.cli.bench import measure_iteration
from fastdeploy_core.cli.bench_serve import make_requests, run_benchmark
from tests.cli.test_bench_serve import _handler


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_with_eta_on_a_terminal_and_silent_in_a_pipe(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress.progress_bar(10, "4 requests", "tokens") as bar:
        bar.update(5)
        bar.refresh()
    assert "4 requests:  50%|" in terminal.getvalue() and "5/10 tokens" in terminal.getvalue()
    assert "ETA " in terminal.getvalue()
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    with progress.progress_bar(10, "4 requests", "tokens") as bar:
        bar.update(10)
    assert pipe.getvalue() == ""


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def update(self, n: int) -> None:
        self.n += n


class _FakeEngine:
    """Requests of ``max_tokens`` each; each step gives every unfinished request up to
    ``per_step`` tokens (more than one is what a step with accepted draft tokens gives)."""

    def __init__(self, per_step: int = 1) -> None:
        self.left: dict[str, int] = {}
        self.per_step = per_step

    def add_request(self, prompt, params):
        rid = str(len(self.left))
        self.left[rid] = params.max_tokens
        return rid

    def has_unfinished_requests(self) -> bool:
        return any(self.left.values())

    def step(self):
        outs = []
        for rid, left in self.left.items():
            if left:
                n = min(left, self.per_step)
                self.left[rid] = left - n
                out = SimpleNamespace(token_ids=[1] * n, delta_token_ids=[1] * n)
                outs.append(SimpleNamespace(request_id=rid, outputs=[out]))
        return outs


def test_offline_benches_advance_by_generated_tokens():
    counter = _Counter()
    result = measure_iteration(_FakeEngine(), [[5, 6], [7, 8]], 3, counter)
    assert counter.n == 6 and result["steps"] == 3
    counter = _Counter()
    result = measure_iteration(_FakeEngine(per_step=2), [[5, 6], [7, 8]], 3, counter)
    assert counter.n == 6 and result["steps"] == 2


def test_bench_serve_advances_by_finished_requests():
    counter = _Counter()
    reqs = make_requests("random", 3, 4, 2, seed=1)
    transport = httpx.MockTransport(_handler)
    summary = asyncio.run(
        run_benchmark("http://fake", "openai", None, reqs, 2, float("inf"), None, transport=transport, progress=counter)
    )
    assert counter.n == 3 and summary["completed"] == 3


def test_plotting_logs_nothing_on_a_machine_without_a_font_cache(tmp_path):
    code = (
        "import logging; logging.basicConfig(level=logging.INFO); "
        "from fastdeploy_core.cli.bench_serve import plot_summaries; "
        "s = {'output_throughput': 1.0, **{k: {'median': 1.0, 'p99': 2.0} for k in "
        "('ttft_ms', 'tpot_ms', 'itl_ms', 'e2el_ms')}}; "
        f"plot_summaries([('run', s)], {str(tmp_path / 'plot.png')!r})"
    )
    env = dict(os.environ, MPLCONFIGDIR=str(tmp_path / "mpl"), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert (tmp_path / "mpl").is_dir() and proc.stderr == "", proc.stderr
