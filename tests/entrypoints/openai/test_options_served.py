"""Request and server options checked by their effect, not by a 200: sampling filters, logit_bias
bans, usage in every chunk, abort_all, chat templates from the operator and from the request,
priority, refused options, and quantization with an int8 KV cache through the server."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import yaml

from tests.entrypoints.openai.conftest import start_server
from tests.entrypoints.openai.test_openai_api import _assert_error, _post, _start_stream, _wait_idle

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def completion_ids(server, prompt, **extra) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True, **extra}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["completion_token_ids"]


# --- sampling options -------------------------------------------------------------------------


def test_top_k_and_min_p_of_one_token_are_greedy_whatever_the_seed(server):
    """top_k=1 and min_p=1 leave only the most likely token, so hot sampling must equal greedy,
    while plain hot sampling with those seeds does not."""
    prompt = "Once upon a time"
    greedy = completion_ids(server, prompt)
    hot = [completion_ids(server, prompt, temperature=1.5, seed=s) for s in (1, 2, 3)]
    assert any(h != greedy for h in hot)  # the filters below are what makes it greedy
    for seed in (1, 2, 3):
        assert completion_ids(server, prompt, temperature=1.5, seed=seed, top_k=1) == greedy
        assert completion_ids(server, prompt, temperature=1.5, seed=seed, min_p=1.0) == greedy


def test_repetition_penalty_repeats_fewer_tokens(server):
    prompt = "one two one two one two one two one two"
    prompt_ids = set(_post(server, "/tokenize", {"prompt": prompt}).json()["tokens"])

    def repeats(ids):
        seen, n = set(prompt_ids), 0
        for t in ids:
            n += t in seen
            seen.add(t)
        return n

    plain = completion_ids(server, prompt)
    penalized = completion_ids(server, prompt, repetition_penalty=10.0)
    assert repeats(plain) >= 6, plain  # the prompt invites repetition
    assert repeats(penalized) < repeats(plain) // 2, (plain, penalized)


def test_logit_bias_minus_100_bans_the_token(server):
    prompt = "The capital of France is"
    greedy = completion_ids(server, prompt)
    banned = greedy[0]
    biased = completion_ids(server, prompt, logit_bias={str(banned): -100})
    assert biased[0] != greedy[0]
    assert banned not in biased


# --- streams ----------------------------------------------------------------------------------


def stream_chunks(server, path, body) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, headers=server.headers(), timeout=60) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(server, path):
    body = {"max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True}
    body.update({"messages": QUESTION} if "chat" in path else {"prompt": "Hello there"})
    plain = stream_chunks(server, path, body)
    assert all(c.get("usage") is None for c in plain)
    chunks = stream_chunks(server, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    prompt_tokens = {u["prompt_tokens"] for u in usages}
    assert len(prompt_tokens) == 1 and prompt_tokens.pop() > 0
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 6
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    # with include_usage too, the closing usage chunk (no choices) agrees with the last one
    both = stream_chunks(server, path, {**body, "stream_options": {"continuous_usage_stats": True,
                                                                   "include_usage": True}})
    assert both[-1]["choices"] == [] and both[-1]["usage"] == usages[-1]


def test_abort_all_aborts_every_running_request(server):
    _wait_idle(server)
    client, resp, lines = _start_stream(server)
    try:
        r = _post(server, "/v1/abort_requests", {"abort_all": True})
        assert r.status_code == 200
        aborted = r.json()["aborted"]
        assert len(aborted) == 1 and aborted[0].startswith("chatcmpl-") and r.json()["not_found"] == []
        rest = "\n".join(lines)
        assert "was aborted through /v1/abort_requests" in rest
    finally:
        resp.close()
        client.close()
    _wait_idle(server, timeout=5)


def test_client_disconnect_non_streaming_aborts_before_it_could_finish(server):
    """The request is seen running, the client leaves, and the engine frees it having generated
    far fewer than the 400 tokens it was held to (without the abort it would generate all 400
    and count as a success)."""
    _wait_idle(server)
    before = server.metrics()
    body = {"prompt": "A long story:", "max_tokens": 400, "min_tokens": 399}
    leave = threading.Event()

    def fire():
        # A non-streaming answer sends its headers with the body, so send() waits for the whole
        # answer; the client leaves when its 5 s read timeout ends that wait (the disconnect the
        # server must notice), or at `leave` if headers came first.
        with httpx.Client(timeout=5.0) as c:
            req = c.build_request("POST", f"{server.url}/v1/completions", json=body, headers=server.headers())
            try:
                resp = c.send(req, stream=True)
            except httpx.ReadTimeout:
                return
            leave.wait(30)
            resp.close()

    t = threading.Thread(target=fire, daemon=True)
    t.start()
    deadline = threading.Event()
    for _ in range(400):
        if server.metrics()["fastdeploy:num_requests_running"] == 1:
            break
        deadline.wait(0.05)
    else:
        raise AssertionError("the request never ran")
    leave.set()
    t.join(10)
    after = _wait_idle(server, timeout=10)
    generated = after["fastdeploy:generation_tokens_total"] - before["fastdeploy:generation_tokens_total"]
    assert generated < 399, generated
    assert after["fastdeploy:request_success_total"] == before["fastdeploy:request_success_total"]
    assert "client disconnected; aborting cmpl-" in server.log()


# --- refused ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_response_format_json_is_enforced_and_a_short_budget_ends_with_length(server, kind):
    fmt = {"type": kind, **({"json_schema": {"name": "x", "schema": {}}} if kind == "json_schema" else {})}
    # one token: the grammar forbids ending before a JSON value has begun, so the budget ends it
    # (with two, a model whose vocabulary holds "{}" may close the object and stop, as one CPU's did)
    r = _post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1, "response_format": fmt})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].lstrip().startswith(("{", "[", '"')) or kind == "json_schema"
    ok = _post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2,
                                                "response_format": {"type": "text"}})
    assert ok.status_code == 200


def test_priority_is_refused_when_the_server_schedules_fcfs(server):
    for path, body in (("/v1/chat/completions", {"messages": QUESTION}), ("/v1/completions", {"prompt": "Hi"})):
        r = _post(server, path, {**body, "max_tokens": 2, "priority": 3})
        _assert_error(r, 400, param="priority")
        assert "--policy priority" in r.json()["error"]["message"]
        assert _post(server, path, {**body, "max_tokens": 2, "priority": 0}).status_code == 200


def test_request_chat_template_is_refused_without_the_operators_flag(server):
    body = {"messages": QUESTION, "max_tokens": 2, "chat_template": "{{ messages[0].content }}",
            "chat_template_kwargs": {"x": 1}}
    _assert_error(_post(server, "/v1/chat/completions", body), 400, param="chat_template",
                  code="chat_template_not_allowed")
    # kwargs alone reach the model's own template (which ignores unknown ones): accepted
    plain = {"messages": QUESTION, "max_tokens": 2, "return_token_ids": True}
    with_kwargs = _post(server, "/v1/chat/completions", {**plain, "chat_template_kwargs": {"unused": 1}})
    assert with_kwargs.status_code == 200
    assert (with_kwargs.json()["choices"][0]["message"]["prompt_token_ids"]
            == _post(server, "/v1/chat/completions", plain).json()["choices"][0]["message"]["prompt_token_ids"])


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--tensor-parallel-size", "0"], "tensor_parallel_size: got 0; must be >= 1"),
        (["--kv-cache-ratio", "0"], "kv_cache_ratio: got 0.0; must be > 0.0"),
        (["--policy", "lottery"], "policy: got 'lottery'; must be one of 'fcfs' or 'priority'"),
    ],
)
def test_serve_refuses_options_it_cannot_honour(flags, says):
    import subprocess

    from tests.entrypoints.openai.conftest import fastdeploy_command

    done = subprocess.run([*fastdeploy_command(), "serve", *flags], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert f"error: {says}" in done.stderr


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--dtype", "float16"], "dtype: float16 is not supported: device cpu does not support it (its dtypes: "
                                 "float32, bfloat16); use --dtype float32, bfloat16 or auto"),
        (["--dtype", "bfloat16", "--quantization", "wint4"],
         "dtype: bfloat16 stores the linear layers in bfloat16, and quantization 'wint4'"),
    ],
)
def test_serve_refuses_dtypes_the_engine_would_not_compute_in(flags, says):
    """Refused when the engine starts (the device decides), before any weight loads: the server
    does not come up and says why."""
    import subprocess

    from tests.entrypoints.openai.conftest import fastdeploy_command

    done = subprocess.run([*fastdeploy_command(), "serve", *flags], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert says in done.stderr


# --- a server with the operator's options -----------------------------------------------------

OPERATOR_TEMPLATE = "OPERATOR: {% for m in messages %}{{ m['content'] }}{% endfor %} ANSWER:"
REQUEST_TEMPLATE = "{{ prefix }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def operated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("operated")
    template = tmp / "template.jinja"
    template.write_text(OPERATOR_TEMPLATE)
    preset = tmp / "preset.yaml"
    preset.write_text(yaml.safe_dump({"kv-cache-dtype": "int8", "quantization": "wint8"}))
    srv = start_server(str(tmp), "--chat-template", str(template), "--trust-request-chat-template",
                       "--policy", "priority", "--config", str(preset))
    yield srv
    srv.stop()


def tokenize(server, text: str) -> list[int]:
    return _post(server, "/tokenize", {"prompt": text}).json()["tokens"]


def test_config_info_shows_what_is_in_effect(operated):
    info = httpx.get(f"{operated.url}/config-info", headers=operated.headers(), timeout=10).json()
    args = info["engine_args"]
    assert (args["quantization"], args["kv_cache_dtype"], args["policy"]) == ("wint8", "int8", "priority")
    assert args["chat_template"] == OPERATOR_TEMPLATE
    # refused options cannot be in effect; their fields show they are off
    assert args["kv_cache_ratio"] is None and args["speculative_config"] is None
    assert args["tensor_parallel_size"] == 1
    assert args["scheduler_name"] == "local" and args["dtype"] == "auto"


def test_servers_chat_template_renders_the_prompt(operated):
    r = _post(operated, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2, "return_token_ids": True})
    assert r.status_code == 200, r.text
    want = tokenize(operated, "OPERATOR: What is the capital of France? ANSWER:")
    assert r.json()["choices"][0]["message"]["prompt_token_ids"] == want


def test_request_chat_template_and_kwargs_when_trusted(operated):
    body = {"messages": QUESTION, "max_tokens": 2, "return_token_ids": True, "chat_template": REQUEST_TEMPLATE,
            "chat_template_kwargs": {"prefix": "KWARG-PREFIX "}}
    r = _post(operated, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    want = tokenize(operated, "KWARG-PREFIX What is the capital of France?")
    assert r.json()["choices"][0]["message"]["prompt_token_ids"] == want


def test_priority_is_accepted_under_the_priority_policy(operated):
    r = _post(operated, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": -4})
    assert r.status_code == 200, r.text


def test_quantized_int8_kv_server_matches_the_offline_engine(operated):
    """wint8 weights and the int8 KV cache run in the served engine: its greedy tokens are the
    offline engine's with the same settings (whose caches tests/quantization checks are int8)."""
    from fastdeploy_core import LLM, SamplingParams

    prompts = ["The capital of France is", "Write a haiku about the sea:"]
    served = [completion_ids(operated, p, max_tokens=16, ignore_eos=True) for p in prompts]
    llm = LLM(model=None, max_model_len=512, block_size=16, max_num_seqs=8, num_gpu_blocks_override=512,
              quantization="wint8", kv_cache_dtype="int8")
    runner = llm.engine.core.runner
    assert str(runner.kv_caches[0][0].data.dtype) == "paddle.int8"
    offline = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)]
    assert served == [list(t) for t in offline]
