"""The commands exit as a user sees them: status 0 and nothing from teardown on stderr, each
in its own process (``fastdeploy generate``, ``chat`` fed a line then end of input, ``bench
latency``, ``bench throughput``, ``bench serve`` against a running server, and ``serve`` stopped
with SIGTERM)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.clean_exit import TEARDOWN_NOISE, assert_clean_exit, run_cli, subprocess_env

SMALL = ["--max-model-len", "512", "--max-num-seqs", "4"]


@pytest.mark.slow
def test_generate_exits_cleanly():
    proc = run_cli("generate", "Hello", "--max-tokens", "4")
    assert_clean_exit(proc)
    assert proc.stdout.strip(), "generate printed no answer"


@pytest.mark.slow
def test_chat_ends_cleanly_at_end_of_input():
    proc = run_cli("chat", "--max-tokens", "16", *SMALL, stdin="What is the capital of France?\n")
    assert_clean_exit(proc)
    assert "Paris" in proc.stdout


@pytest.mark.slow
def test_bench_latency_exits_cleanly():
    proc = run_cli(
        "bench",
        "latency",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--batch-size",
        "1",
        "--num-iters-warmup",
        "0",
        "--num-iters",
        "1",
        *SMALL,
    )
    assert_clean_exit(proc)
    assert "tok/s" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_bench_throughput_exits_cleanly(tmp_path):
    out = tmp_path / "throughput.json"
    proc = run_cli(
        "bench", "throughput", "--input-len", "8", "--output-len", "4", "--num-prompts", "3",
        "--output-json", str(out), *SMALL,
    )
    assert_clean_exit(proc)
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 3, result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_stopped_with_sigterm_exits_zero_and_bench_serve_exits_cleanly(tmp_path):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastdeploy_core.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *SMALL],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 4}
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        bench = run_cli(
            "bench", "serve", "--base-url", base, "--num-prompts", "2", "--random-input-len", "8",
            "--random-output-len", "4", "--result-file", str(tmp_path / "serve.json"),
        )
        assert_clean_exit(bench)
        summary = json.loads((tmp_path / "serve.json").read_text())
        assert summary["completed"] == 2 and summary["failed"] == 0, summary
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{stderr[-3000:]}"
    noise = [marker for marker in TEARDOWN_NOISE if marker in stderr]
    assert not noise, f"teardown noise {noise} on stderr:\n{stderr[-3000:]}"
    assert "engine core stopped" in stderr  # the engine core process was shut down, not orphaned
