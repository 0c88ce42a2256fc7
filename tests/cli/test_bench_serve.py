"""``fastdeploy bench serve``'s client against a fake OpenAI-compatible server (httpx MockTransport)."""

from __future__ import annotations

import asyncio
import json

import httpx

from fastdeploy_core.cli.bench_serve import format_summary, make_requests, run_benchmark


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
