"""``fastdeploy bench serve``: its client against a fake OpenAI-compatible server (httpx MockTransport),
and the command against a real ``fastdeploy serve`` with the default model."""

from __future__ import annotations

import asyncio
import json
import subprocess

import httpx
import pytest

from fastdeploy_core.cli.bench_serve import format_summary, make_requests, run_benchmark
from tests.entrypoints.openai.conftest import API_KEY, fastdeploy_command, start_server


def _sse(payloads: list) -> bytes:
    return "".join(f"data: {json.dumps(p) if not isinstance(p, str) else p}\n\n" for p in payloads).encode()


def _handler(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"data": [{"id": "fake"}]})
    body = json.loads(request.content)
    if body["prompt"].startswith("fail"):
        return httpx.Response(500, json={"error": {"message": "boom"}})
    n = body["max_tokens"]
    chunks = [{"choices": [{"index": 0, "text": f" t{i}"}]} for i in range(n)]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}})
    return httpx.Response(200, content=_sse([*chunks, "[DONE]"]), headers={"content-type": "text/event-stream"})


def test_bench_serve_counts_tokens_latencies_failures_and_load():
    reqs = make_requests("random", 3, 4, 6, seed=1)
    reqs[2].prompt = "fail " + reqs[2].prompt
    summary = asyncio.run(
        run_benchmark("http://fake", "openai", None, reqs, 2, float("inf"), None, transport=httpx.MockTransport(_handler))
    )
    assert summary["model"] == "fake"
    assert summary["completed"] == 2 and summary["failed"] == 1 and "HTTP 500" in summary["errors"][0]
    assert summary["total_output_tokens"] == 12 and summary["total_input_tokens"] == 10
    assert summary["ttft_ms"]["median"] >= 0 and summary["e2el_ms"]["median"] >= summary["ttft_ms"]["median"]
    assert len(summary["per_request"]) == 3
    assert len(summary["load_before"]) == 3 and len(summary["load_after"]) == 3
    text = format_summary(summary)
    assert "Load average" in text and "Failed requests                 1" in text


def test_bench_serve_same_seed_same_prompts():
    a = make_requests("sharegpt", 5, 32, 16, seed=7)
    b = make_requests("sharegpt", 5, 32, 16, seed=7)
    assert [(r.prompt, r.output_len) for r in a] == [(r.prompt, r.output_len) for r in b]


@pytest.mark.slow
def test_bench_serve_against_a_real_server(tmp_path):
    """The whole command against our own server: every request completes, none fails, and the
    output tokens are the server's own usage counts (ignore_eos makes each request produce
    exactly its max_tokens), so a client that stopped reading the stream or the usage chunk
    would miss them."""
    server = start_server(str(tmp_path))
    try:
        result_file = tmp_path / "bench.json"
        proc = subprocess.run(
            [*fastdeploy_command(), "bench", "serve", "--base-url", server.url, "--api-key", API_KEY,
             "--num-prompts", "3", "--max-concurrency", "2", "--random-input-len", "6",
             "--random-output-len", "4", "--seed", "3", "--result-file", str(result_file)],
            capture_output=True, text=True, timeout=300, check=False,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        summary = json.loads(result_file.read_text())
        assert summary["num_prompts"] == 3 and len(summary["per_request"]) == 3
        assert summary["completed"] == 3 and summary["failed"] == 0, summary["errors"]
        assert summary["total_output_tokens"] == 3 * 4
        assert [r["output_tokens"] for r in summary["per_request"]] == [4, 4, 4]
        assert all(r["prompt_tokens"] >= 6 for r in summary["per_request"])
        assert summary["total_input_tokens"] == sum(r["prompt_tokens"] for r in summary["per_request"])
        assert summary["model"] == httpx.get(f"{server.url}/v1/models", headers=server.headers()).json()["data"][0]["id"]
        assert "Successful requests             3" in proc.stdout and "Failed requests                 0" in proc.stdout
        # The server's own counters agree: a fresh server saw exactly these requests and tokens.
        served = server.metrics()
        assert served["fastdeploy:request_success_total"] == 3
        assert served["fastdeploy:generation_tokens_total"] == 12
    finally:
        server.stop()
