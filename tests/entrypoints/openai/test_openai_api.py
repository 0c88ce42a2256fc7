"""The OpenAI-compatible server, driven by the official ``openai`` client and by raw HTTP."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import API_KEY, SECOND_KEY

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Long enough to fill several 16-token KV blocks, so a repeat hits the prefix cache.
LONG_SYSTEM = (
    "You are a careful assistant for geography questions. Answer briefly and precisely, "
    "name the country and the city, and never invent facts you are not sure about. "
)


# --- happy paths through the openai client ----------------------------------------------------


def test_models_lists_the_served_model(client, model_name):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert model_name == "SmolLM2-135M-Instruct"


def test_chat_completion(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 5
    assert 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("chatcmpl-")


def test_max_completion_tokens_limits_length(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=QUESTION, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


def test_completion_prompt_forms(client, model_name, server):
    text = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert text.choices[0].text.strip()
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The capital of France is"},
                     headers=server.headers()).json()["tokens"]
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text
    batch = client.completions.create(model=model_name, prompt=["One, two,", "The capital of France is"],
                                      max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[1].text == text.choices[0].text
    id_batch = client.completions.create(model=model_name, prompt=[ids, ids[:3]], max_tokens=2, temperature=0)
    assert len(id_batch.choices) == 2
    assert id_batch.usage.prompt_tokens == len(ids) + 3


def test_completion_echo_and_logprobs(client, model_name):
    prompt = "The capital of France is"
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = r.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) == 2 for t in lp.top_logprobs[-3:])
    assert lp.text_offset[0] == 0


def test_chat_logprobs(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_streaming_chat_role_first_then_done(server, model_name):
    body = {"model": model_name, "messages": QUESTION, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=server.headers(),
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: ")
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finals = [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]]
    assert finals[-1] in ("stop", "length")
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] > 0
    assert "cached_tokens" in usage["prompt_tokens_details"]
    non_stream = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": False,
                            "stream_options": None}, headers=server.headers(), timeout=60).json()
    assert non_stream["choices"][0]["message"]["content"] == text


def test_streaming_with_openai_client(client, model_name):
    stream = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=8, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    completion = client.completions.create(model=model_name, prompt="Hello", max_tokens=5, stream=True, temperature=0)
    pieces = list(completion)
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")


def test_n_choices(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=8, n=2, temperature=1.0,
                                       seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert 2 <= r.usage.completion_tokens <= 16
    streamed = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=6, n=2,
                                         temperature=1.0, seed=3, stream=True)
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts[0] and texts[1]


def test_seed_reproducibility(client, model_name):
    kwargs = {"model": model_name, "messages": [{"role": "user", "content": "Write a word."}], "max_tokens": 10,
              "temperature": 1.0, "top_p": 0.95, "seed": 1234}
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b
    others = {client.chat.completions.create(**{**kwargs, "seed": s}).choices[0].message.content for s in (1, 2, 3)}
    assert len(others | {a}) > 1  # the seed matters


def test_stop_string(client, model_name):
    base = client.completions.create(model=model_name, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    assert len(text) > 4
    stop = text[3:5]
    cut = text[: text.index(stop)]
    stopped = client.completions.create(model=model_name, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0,
                                        stop=[stop])
    assert stopped.choices[0].text == cut
    assert stopped.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=model_name, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0,
                                     stop=stop, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop


def test_cached_tokens_on_repeated_prompt(client, model_name):
    messages = [{"role": "system", "content": LONG_SYSTEM * 2}, *QUESTION]
    first = client.chat.completions.create(model=model_name, messages=messages, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model=model_name, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 32
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


def test_fastdeploy_extras(server, model_name):
    body = {"model": model_name, "messages": QUESTION, "max_tokens": 4, "temperature": 0, "top_k": 5,
            "min_p": 0.01, "repetition_penalty": 1.1, "return_token_ids": True, "request_id": "my-req-1",
            "some_unknown_field": {"x": 1}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers(), timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["id"] == "my-req-1"
    msg = data["choices"][0]["message"]
    assert len(msg["completion_token_ids"]) == data["usage"]["completion_tokens"]
    assert len(msg["prompt_token_ids"]) == data["usage"]["prompt_tokens"]
    assert "some_unknown_field" in server.log()


def test_tokenize_detokenize(server):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}, headers=server.headers())
    assert r.status_code == 200
    data = r.json()
    assert data["count"] == len(data["tokens"]) > 0
    assert data["max_model_len"] == 512
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": data["tokens"]}, headers=server.headers())
    assert back.json()["prompt"] == "Hello world"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION}, headers=server.headers()).json()
    assert chat["count"] > data["count"]


def test_health_ping_config_metrics(server):
    messages = [{"role": "system", "content": LONG_SYSTEM * 2}, *QUESTION]
    for _ in range(2):  # a repeated prompt: the second one hits the prefix cache
        assert _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}).status_code == 200
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.post(f"{server.url}/ping").status_code == 200
    info = httpx.get(f"{server.url}/config-info", headers=server.headers()).json()
    assert info["max_model_len"] == 512
    assert "api_key" not in info["server"]
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "time_to_first_token_seconds",
                 "time_per_output_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "prompt_tokens_total", "generation_tokens_total", "request_success_total", "gpu_cache_usage_perc",
                 "hit_token_rate", "free_gpu_block_num"):
        assert f"fastdeploy:{name}" in text, name
    separate = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics").text
    assert "fastdeploy:request_success_total" in separate  # --metrics-port serves the same registry
    m = server.metrics()
    assert m["fastdeploy:request_success_total"] > 0
    assert m["fastdeploy:generation_tokens_total"] > 0
    assert m["fastdeploy:hit_token_rate"] > 0  # the repeated prompt hit the prefix cache


# --- failures over raw HTTP -------------------------------------------------------------------


def _post(server, path, body=None, *, content=None, key=API_KEY):
    kwargs = {"content": content} if content is not None else {"json": body}
    return httpx.post(f"{server.url}{path}", headers={**server.headers(key), "content-type": "application/json"},
                      timeout=60, **kwargs)


def _assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": [1]}, "temperature"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"model": "x"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 5000}, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
         "response_format"),
        ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, "response_format"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "hi"}], "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_invalid_chat_requests_are_400(server, body, param):
    err = _assert_error(_post(server, "/v1/chat/completions", body), 400, param=param)
    assert err["type"] == "invalid_request_error"


def test_malformed_tools_and_formats_say_what_to_send(server):
    r = _post(server, "/v1/chat/completions", {"messages": QUESTION, "tools": [{"type": "function"}]})
    assert '"function": {"name": ...' in r.json()["error"]["message"]
    r = _post(server, "/v1/chat/completions", {"messages": QUESTION, "response_format": {"type": "json_schema"}})
    assert "needs json_schema.schema" in r.json()["error"]["message"]


def test_malformed_json_is_400(server):
    for raw in (b"{", b"not json", b"[1, 2]", b"", b"\xff\xfe"):
        _assert_error(_post(server, "/v1/chat/completions", content=raw), 400)
        _assert_error(_post(server, "/v1/completions", content=raw), 400)


def test_invalid_completion_requests_are_400(server):
    _assert_error(_post(server, "/v1/completions", {"prompt": 12}), 400, param="prompt")
    _assert_error(_post(server, "/v1/completions", {"prompt": []}), 400, param="prompt")
    _assert_error(_post(server, "/v1/completions", {"prompt": "x", "logprobs": 99}), 400, param="logprobs")
    _assert_error(_post(server, "/v1/completions", {"prompt": [10**9]}), 400, param="prompt")


def test_prompt_over_max_model_len_is_400(server):
    long_text = "hello " * 800
    err = _assert_error(_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}),
                        400, code="context_length_exceeded")
    assert "512" in err["message"]
    _assert_error(_post(server, "/v1/completions", {"prompt": long_text}), 400, code="context_length_exceeded")
    _assert_error(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 600}), 400,
                  code="context_length_exceeded")


def test_unknown_model_is_404(server):
    err = _assert_error(_post(server, "/v1/chat/completions", {"model": "gpt-9", "messages": QUESTION}), 404,
                        code="model_not_found")
    assert "gpt-9" in err["message"]
    _assert_error(_post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404)


def test_api_key_required_on_every_v1_route(server):
    routes = [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", {"messages": QUESTION}),
              ("POST", "/v1/completions", {"prompt": "x"}), ("POST", "/v1/abort_requests", {"req_ids": []})]
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
            r = httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=30)
            _assert_error(r, 401)
    assert httpx.get(f"{server.url}/v1/models", headers=server.headers(SECOND_KEY)).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()


def test_unknown_route_is_404_json(server):
    r = httpx.get(f"{server.url}/v1/nothing-here", headers=server.headers())
    assert r.status_code == 404
    assert "error" in r.json()


# --- disconnects, limits ------------------------------------------------------------------------


def _wait_idle(server, timeout=20.0):
    """Until the engine reports nothing running or waiting and every KV block free."""
    deadline = time.monotonic() + timeout
    m = {}
    while time.monotonic() < deadline:
        m = server.metrics()
        if (m["fastdeploy:num_requests_running"] == 0 and m["fastdeploy:num_requests_waiting"] == 0
                and m["fastdeploy:free_gpu_block_num"] == m["fastdeploy:max_gpu_block_num"] > 0):
            return m
        time.sleep(0.05)
    raise AssertionError(f"engine not idle after {timeout} s: {m}")


def _start_stream(server, max_tokens=400, kind="chat"):
    """Open a streaming request and read its first content chunk; returns the open response."""
    client = httpx.Client(timeout=60)
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
                "max_tokens": max_tokens, "temperature": 1.0, "stream": True, "min_tokens": max_tokens - 1}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": "A long story:", "max_tokens": max_tokens, "stream": True, "min_tokens": max_tokens - 1}
        path = "/v1/completions"
    req = client.build_request("POST", f"{server.url}{path}", json=body, headers=server.headers())
    resp = client.send(req, stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    seen = 0
    for line in lines:
        seen += line.startswith("data: ")
        if seen >= 3:  # the role chunk, then generated tokens: the request is running
            break
    return client, resp, lines


def test_client_disconnect_mid_stream_frees_blocks(server):
    _wait_idle(server)
    client, resp, lines = _start_stream(server)
    next(lines)
    running = server.metrics()
    assert running["fastdeploy:num_requests_running"] == 1
    assert running["fastdeploy:free_gpu_block_num"] < running["fastdeploy:max_gpu_block_num"]
    resp.close()
    client.close()
    _wait_idle(server, timeout=5)


# The non-streaming disconnect is checked by its effect (tokens generated, success counter) in
# test_options_served.py::test_client_disconnect_non_streaming_aborts_before_it_could_finish.


def test_over_concurrency_is_429(server):
    _wait_idle(server)
    streams = [_start_stream(server, kind="completion") for _ in range(4)]  # --max-concurrency 4
    try:
        err = _assert_error(_post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2}), 429)
        assert "max-concurrency" in err["message"]
    finally:
        for client, resp, _ in streams:
            resp.close()
            client.close()
    _wait_idle(server, timeout=10)
    ok = _post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2})
    assert ok.status_code == 200


def test_abort_requests_endpoint(server):
    _wait_idle(server)
    body = {"prompt": "A long story:", "max_tokens": 400, "min_tokens": 399, "request_id": "to-abort"}
    result = {}

    def fire():
        result["r"] = _post(server, "/v1/completions", body)

    t = threading.Thread(target=fire)
    t.start()
    deadline = time.monotonic() + 20
    while server.metrics()["fastdeploy:num_requests_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = _post(server, "/v1/abort_requests", {"req_ids": ["to-abort", "missing"]})
    assert r.json() == {"aborted": ["to-abort"], "not_found": ["missing"]}
    t.join(30)
    assert result["r"].status_code == 499
    _wait_idle(server, timeout=5)


def test_completion_stream_echo_usage_and_batch(server):
    body = {"prompt": ["Hello there", "One, two,"], "max_tokens": 4, "temperature": 0, "echo": True, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    texts: dict[int, str] = {}
    usage = None
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers(), timeout=60) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for raw in lines[:-1]:
        chunk = json.loads(raw)
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        usage = chunk.get("usage") or usage
    assert sorted(texts) == [0, 1, 2, 3]
    assert texts[0].startswith("Hello there") and texts[2].startswith("One, two,")
    assert texts[0] == texts[1]  # greedy: both choices agree
    assert usage["completion_tokens"] == 16
    plain = _post(server, "/v1/completions", {**body, "stream": False, "stream_options": None}).json()
    assert [c["text"] for c in plain["choices"]] == [texts[i] for i in range(4)]


def test_disable_chat_template_sends_raw_text(server):
    raw = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "The capital of France is"}],
                                                 "max_tokens": 4, "temperature": 0, "disable_chat_template": True})
    completion = _post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4,
                                                   "temperature": 0})
    assert raw.status_code == completion.status_code == 200
    assert raw.json()["choices"][0]["message"]["content"] == completion.json()["choices"][0]["text"]
    assert raw.json()["usage"]["prompt_tokens"] == completion.json()["usage"]["prompt_tokens"]
