"""Hostile and careless input: every bad request is a 4xx with a message, the event loop stays
responsive, internals and templates stay behind the operator's flags, limits answer correctly."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdeploy_core.entrypoints.openai.protocol import ChatCompletionRequest
from fastdeploy_core.entrypoints.openai.request_body import MAX_JSON_DEPTH, decode_json, json_depth, parse_body
from fastdeploy_core.errors import InvalidRequestError
from fastdeploy_core.tokenizer.chat_template import render_chat_template
from tests.entrypoints.openai.conftest import API_KEY, free_port, start_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
VOCAB = 49152  # SmolLM2-135M-Instruct, the embedded default model


# --- without a server ---------------------------------------------------------------------------


def test_json_nesting_limit_counts_only_structure():
    assert json_depth(b'{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}') == 1
    assert json_depth(b"[" * 70 + b"]" * 70) == 70
    assert json_depth(b'["\\"[[", [[1]]]') == 3
    with pytest.raises(InvalidRequestError, match="100000 levels deep"):
        decode_json(b"[" * 100_000 + b"]" * 100_000)
    assert decode_json(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH) is not None


def test_lone_surrogates_are_refused_with_their_place():
    with pytest.raises(InvalidRequestError) as info:
        decode_json(b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}')
    assert info.value.param == "messages" and "messages.0.content" in info.value.message
    # a proper pair is one character and passes
    assert decode_json(b'{"x": "\\ud83d\\ude00"}') == {"x": "\U0001f600"}


def test_logit_bias_keys_must_be_ascii_token_ids():
    with pytest.raises(InvalidRequestError) as info:
        parse_body(ChatCompletionRequest, json.dumps({"messages": QUESTION, "logit_bias": {"²": -100}}).encode())
    assert info.value.param == "logit_bias"


def test_chat_template_rendering_is_bounded_in_size_and_time():
    messages = [{"role": "user", "content": "hi"}]
    t0 = time.monotonic()
    with pytest.raises(InvalidRequestError) as info:
        render_chat_template("{{ 'ab ' * 2000000 }}", messages)
    assert info.value.code == "chat_template_limit" and time.monotonic() - t0 < 0.5
    for source in ("{{ 'x'|center(999999999) }}", "{{ 'x'.ljust(999999999) }}", "{{ 9 ** 999999999 }}",
                   "{{ '%0999999999d' % 1 }}"):
        with pytest.raises(InvalidRequestError, match="at most"):
            render_chat_template(source, messages)
    t0 = time.monotonic()
    with pytest.raises(InvalidRequestError, match="longer than"):
        render_chat_template("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", messages)
    assert time.monotonic() - t0 < 5
    with pytest.raises(InvalidRequestError, match="at most 100 "):
        render_chat_template("{% for m in messages %}{{ m.content * 30 }}{% endfor %}", messages * 5, max_chars=100)
    assert render_chat_template("{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}", messages) == "user: hi"


# --- against the shared server ------------------------------------------------------------------


def _post(server, path, body=None, *, content=None, headers=None, timeout=60):
    hdrs = {**server.headers(), "content-type": "application/json", **(headers or {})}
    kwargs = {"content": content} if content is not None else {"json": body}
    return httpx.post(f"{server.url}{path}", headers=hdrs, timeout=timeout, **kwargs)


def _error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.slow
def test_internals_need_the_key_probes_do_not(server):
    _error(httpx.get(f"{server.url}/config-info"), 401)
    _error(httpx.get(f"{server.url}/config-info", headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(f"{server.url}/config-info", headers=server.headers()).json()["max_model_len"] == 512
    for path in ("/health", "/ping", "/metrics"):
        assert httpx.get(f"{server.url}{path}").status_code == 200, path


@pytest.mark.slow
def test_openapi_describes_the_request_bodies(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest"),
                        ("/v1/abort_requests", "AbortRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"] == f"#/components/schemas/{model}", path
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [[-1], [10**30], [VOCAB], [[5, VOCAB + 7]]])
def test_token_id_prompts_out_of_range_are_400(server, prompt):
    err = _error(_post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2}), 400, param="prompt")
    assert f"[0, {VOCAB})" in err["message"]


@pytest.mark.slow
def test_bad_inputs_of_the_issue_are_4xx_with_a_message(server):
    _error(_post(server, "/tokenize", {"messages": []}), 400, param="messages")
    _error(_post(server, "/detokenize", {"tokens": [10**30]}), 400, param="tokens")
    surrogate = b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'
    err = _error(_post(server, "/v1/chat/completions", content=surrogate), 400, param="messages")
    assert "surrogate" in err["message"]
    _error(_post(server, "/v1/completions", content=b'{"prompt": "\\udfff x"}'), 400, param="prompt")
    _error(_post(server, "/v1/chat/completions", {"messages": QUESTION, "logit_bias": {"²": -100}}), 400,
           param="logit_bias")
    err = _error(_post(server, "/v1/chat/completions", {"messages": QUESTION, "logit_bias": {"999999": -100}}), 400,
                 param="logit_bias")
    assert f"[0, {VOCAB})" in err["message"]
    _error(_post(server, "/v1/completions", {"prompt": "x", "stop_token_ids": [-3]}), 400, param="stop_token_ids")
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    err = _error(_post(server, "/v1/chat/completions", content=deep), 400, code="invalid_json")
    assert "deep" in err["message"]
    err = _error(_post(server, "/v1/chat/completions", content=json.dumps({"messages": QUESTION}).encode(),
                       headers={"content-type": "text/plain"}), 415, code="unsupported_media_type")
    assert "application/json" in err["message"]
    huge = json.dumps({"messages": QUESTION, "unknown": "x" * (20 * 1024 * 1024)}).encode()
    err = _error(_post(server, "/v1/chat/completions", content=huge), 413, code="request_too_large")
    assert "--max-request-body-bytes" in err["message"]
    # the server still serves
    assert _post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2}).status_code == 200


@pytest.mark.slow
def test_request_chat_template_needs_the_operators_flag(server):
    body = {"messages": QUESTION, "chat_template": "{{ 'ab ' * 2000000 }}"}
    for path in ("/v1/chat/completions", "/tokenize"):
        err = _error(_post(server, path, body), 400, param="chat_template", code="chat_template_not_allowed")
        assert "--trust-request-chat-template" in err["message"]


def _health_latencies(server, stop: threading.Event) -> list[float]:
    latencies = []
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            t0 = time.monotonic()
            assert client.get(f"{server.url}/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.01)
    return latencies


@pytest.mark.slow
def test_health_answers_while_huge_requests_are_refused(server):
    statuses: list[int] = []

    def heavy():
        with httpx.Client(timeout=120, headers={**server.headers(), "content-type": "application/json"}) as c:
            huge = json.dumps({"messages": [{"role": "user", "content": "hello world " * 1_750_000}]}).encode()
            statuses.append(c.post(f"{server.url}/v1/chat/completions", content=huge).status_code)  # 20 MB
            # just under the 4 MiB limit: read, validated and refused in worker threads
            big = json.dumps({"messages": [{"role": "user", "content": "hello world " * 340_000}]}).encode()
            statuses.append(c.post(f"{server.url}/v1/chat/completions", content=big).status_code)
            ids = json.dumps({"prompt": [1] * 1_000_000}).encode()  # ~3 MB of token ids: slow to validate
            statuses.append(c.post(f"{server.url}/v1/completions", content=ids).status_code)

    # The probes' latency with nothing else to do first: on a machine busy with other work this is
    # already slower, and the bar below is "under 100 ms, or no slower than an idle loop here".
    quiet_stop = threading.Event()
    quiet: dict[str, list[float]] = {}
    quiet_prober = threading.Thread(target=lambda: quiet.setdefault("lat", _health_latencies(server, quiet_stop)))
    quiet_prober.start()
    time.sleep(1.0)
    quiet_stop.set()
    quiet_prober.join(30)
    idle = sorted(quiet["lat"])[int(0.9 * (len(quiet["lat"]) - 1))]
    bar = max(0.1, 3 * idle)

    stop = threading.Event()
    result: dict[str, list[float]] = {}
    prober = threading.Thread(target=lambda: result.setdefault("lat", _health_latencies(server, stop)))
    prober.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    heavy()
    elapsed = time.monotonic() - t0
    stop.set()
    prober.join(30)
    assert statuses == [413, 400, 400]
    latencies = result["lat"]
    assert len(latencies) >= 5
    # the client thread shares this machine's cores with the server: one slow probe is noise,
    # a frozen loop shows as many (before, /health took 29 s during one such request)
    slow = [x for x in latencies if x > bar]
    # Parsing a 4 MB body in a worker thread still holds the GIL for one C call (tens of ms on an
    # idle core, up to about a second on a loaded one): a few probes may wait that long, none may
    # wait for the whole request (the frozen loop this guards against held /health for 3.5-29 s).
    assert len(slow) <= max(2, len(latencies) // 5), (sorted(latencies)[-5:], elapsed, bar)
    # none waits anywhere near the frozen loop's 3.5 s (a loaded CI machine delayed one probe 1.2 s)
    assert max(latencies) < 2.5, (sorted(latencies)[-5:], elapsed)


def _open_stream(server, path="/v1/completions"):
    client = httpx.Client(timeout=60)
    body = {"prompt": "A long story:", "max_tokens": 300, "min_tokens": 299, "stream": True}
    resp = client.send(client.build_request("POST", f"{server.url}{path}", json=body, headers=server.headers()),
                       stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    first = next(lines)
    assert first.startswith("data: {") and '"text"' in first, first
    return client, resp, lines  # dropping the line iterator would close the response


@pytest.mark.slow
def test_429_has_retry_after_is_not_counted_and_reconnects_find_their_places(server):
    streams = [_open_stream(server) for _ in range(4)]  # --max-concurrency 4
    try:
        before = server.metrics()["fastdeploy:requests_number_total"]
        r = _post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2})
        _error(r, 429, code="rate_limit_exceeded")
        assert int(r.headers["retry-after"]) >= 1
        assert server.metrics()["fastdeploy:requests_number_total"] == before
    finally:
        for client, resp, _ in streams:
            resp.close()
            client.close()
    # reconnect at once: the closed streams' places must be free (or freed within the grace)
    again = [_open_stream(server) for _ in range(4)]
    for client, resp, _ in again:
        resp.close()
        client.close()
    # a stream read to its end has given its place back before the client saw [DONE]
    for _ in range(2):
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", f"{server.url}/v1/completions", headers=server.headers(),
                          json={"prompt": "Hi", "max_tokens": 2, "stream": True}) as r:
                assert r.status_code == 200
                assert list(r.iter_lines())[-2] == "data: [DONE]"
    seen: list[int] = []
    for _ in range(8):
        with httpx.Client(timeout=60) as c:
            for _ in range(4):
                with c.stream("POST", f"{server.url}/v1/completions", headers=server.headers(),
                              json={"prompt": "Hi", "max_tokens": 1, "stream": True}) as r:
                    seen.append(r.status_code)
                    r.read()
    assert set(seen) == {200}


# --- fuzzing the request models against the live server ----------------------------------------

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                       st.text(max_size=8))
_any_json = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=3)
                         | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)
_text = st.one_of(st.text(max_size=20), st.sampled_from(["\ud800", "a\udfffb", "²", "", "{{ x }}", "Paris"]))
_token_ids = st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(-(2**64), 2**64)), max_size=6)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "wizard"]) | _text},
    optional={"content": st.one_of(_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text}),
                                                   max_size=2), _any_json), "name": _text},
)
_sampling = {
    "model": st.sampled_from(["SmolLM2-135M-Instruct", "gpt-9"]) | _text,
    "max_tokens": st.integers(-2, 3) | _any_json,
    "n": st.integers(-1, 20), "temperature": st.floats(-1, 3) | _any_json, "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 100), "min_p": st.floats(-1, 2), "seed": st.integers(-5, 2**65),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 1e308), "stop": st.one_of(_text, st.lists(_text, max_size=3), _any_json),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-5, VOCAB + 5).map(str), _text),
                                  st.floats(-200, 200) | _any_json, max_size=3),
    "stop_token_ids": _token_ids, "bad_words": st.lists(_text, max_size=2), "min_tokens": st.integers(-1, 5),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _any_json,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "x"])}),
    "request_id": _text, "ignore_eos": st.booleans(), "return_token_ids": st.booleans(), "unknown_field": _any_json,
}
_chat = st.fixed_dictionaries(
    {"messages": st.lists(_message, max_size=3) | _any_json},
    optional={**_sampling, "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 25),
              "max_completion_tokens": st.integers(-1, 3), "chat_template_kwargs": _any_json,
              "add_generation_prompt": st.booleans(), "disable_chat_template": st.booleans(),
              "tools": _any_json, "tool_choice": _any_json},
)
_completion = st.fixed_dictionaries(
    {"prompt": st.one_of(_text, st.lists(_text, max_size=3), _token_ids, st.lists(_token_ids, max_size=2), _any_json)},
    optional={**_sampling, "echo": st.booleans(), "logprobs": st.integers(-1, 25), "suffix": _text,
              "best_of": st.integers(-1, 3)},
)
_tokenize = st.fixed_dictionaries({}, optional={"prompt": _text | _any_json, "messages": st.lists(_message, max_size=2),
                                                "add_special_tokens": st.booleans(), "model": _text})
_detokenize = st.fixed_dictionaries({"tokens": _token_ids | _any_json})
_cases = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), _chat),
    st.tuples(st.just("/v1/completions"), _completion),
    st.tuples(st.just("/tokenize"), _tokenize),
    st.tuples(st.just("/detokenize"), _detokenize),
    st.tuples(st.just("/v1/abort_requests"), st.fixed_dictionaries({}, optional={"req_ids": _any_json,
                                                                                 "abort_all": _any_json})),
)


def _keep_short(body):
    # Valid requests generate at most 3 tokens, so a few hundred cases take seconds, not minutes.
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 3:
        body["max_tokens"] = 3
    if isinstance(body, dict) and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 2
    return body


@pytest.mark.slow
@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=_cases)
def test_fuzzed_requests_never_get_5xx(server, case):
    path, body = case
    raw = json.dumps(_keep_short(body), allow_nan=True).encode()
    r = _post(server, path, content=raw, timeout=60)
    assert r.status_code < 500, (path, raw[:300], r.text[:500])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "internal_error" not in r.text, (path, raw[:300], r.text[:500])


# --- a server started with the operator's flags -----------------------------------------------


@pytest.mark.slow
def test_operator_flags_metrics_key_trusted_templates_and_gauges_of_a_dead_engine(tmp_path):
    metrics_port = free_port()
    srv = start_server(str(tmp_path), "--protect-metrics", "--trust-request-chat-template",
                       "--metrics-port", str(metrics_port))
    try:
        for url in (f"{srv.url}/metrics", f"http://127.0.0.1:{metrics_port}/metrics"):
            assert httpx.get(url).status_code == 401, url
            assert "fastdeploy:requests_number_total" in httpx.get(url, headers=srv.headers()).text
        assert httpx.get(f"{srv.url}/health").status_code == 200
        template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        r = _post(srv, "/tokenize", {"messages": QUESTION, "chat_template": template})
        assert r.status_code == 200, r.text
        plain = _post(srv, "/tokenize", {"prompt": "<user>" + QUESTION[0]["content"]}).json()
        assert r.json()["tokens"] == plain["tokens"]
        t0 = time.monotonic()
        _error(_post(srv, "/v1/chat/completions", {"messages": QUESTION, "chat_template": "{{ 'ab ' * 2000000 }}"}),
               400, code="chat_template_limit")
        assert time.monotonic() - t0 < 2

        def scrape():
            text = httpx.get(f"{srv.url}/metrics", headers=srv.headers()).text
            return {ln.rpartition(" ")[0]: float(ln.rpartition(" ")[2]) for ln in text.splitlines()
                    if ln and not ln.startswith("#")}

        core_pid = httpx.get(f"{srv.url}/config-info", headers=srv.headers()).json()["engine_core_pid"]
        client, resp, _ = _open_stream(srv)
        deadline = time.monotonic() + 30
        while scrape()["fastdeploy:num_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scrape()["fastdeploy:gpu_cache_usage_perc"] > 0
        os.kill(core_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{srv.url}/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        resp.close()
        client.close()
        m = scrape()
        assert m["fastdeploy:num_requests_running"] == 0
        assert m["fastdeploy:gpu_cache_usage_perc"] == 0
        assert m["fastdeploy:max_gpu_block_num"] == 0
    finally:
        srv.stop()


def test_protect_metrics_without_a_key_is_a_config_error(monkeypatch):
    from fastdeploy_core.cli.serve import build_configs
    from fastdeploy_core.errors import ConfigError

    monkeypatch.delenv("FD_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="--api-key"):
        build_configs({}, {"protect_metrics": True})
    _, server = build_configs({}, {"protect_metrics": True, "api_key": [API_KEY], "max_request_body_bytes": 2048})
    assert server.protect_metrics and server.max_request_body_bytes == 2048
    assert not server.trust_request_chat_template
