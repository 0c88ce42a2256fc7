"""Fast checks without a server: flag/preset precedence, API keys, admission limits, protocol shapes."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from fastdeploy_core.cli.serve import build_configs, load_preset
from fastdeploy_core.entrypoints.openai.auth import APIKeyChecker, collect_api_keys
from fastdeploy_core.entrypoints.openai.errors import APIError
from fastdeploy_core.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fastdeploy_core.entrypoints.openai.request_body import parse_body
from fastdeploy_core.entrypoints.openai.serving_engine import Admission
from fastdeploy_core.errors import ConfigError, InvalidRequestError


def test_preset_values_apply_and_explicit_flags_win(tmp_path, monkeypatch):
    monkeypatch.delenv("FD_API_KEY", raising=False)
    preset = tmp_path / "preset.yaml"
    preset.write_text("max-num-seqs: 4\nport: 9001\nblock_size: 32\napi-key: from-preset\nenable-prefix-caching: false\n")
    values = load_preset(str(preset))
    engine, server = build_configs(values, {"max_num_seqs": 16, "port": None, "block_size": None})
    assert engine.scheduler.max_num_seqs == 16  # flag wins
    assert engine.cache.block_size == 32  # preset applies
    assert engine.cache.enable_prefix_caching is False
    assert server.port == 9001
    assert server.api_key == ["from-preset"]


def test_preset_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max-num-sqs: 4\n")
    with pytest.raises(ConfigError, match="max_num_sqs"):
        build_configs(load_preset(str(bad)), {})
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_preset(str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        load_preset(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="port"):
        build_configs({}, {"port": 70000})


def test_api_keys_from_flags_and_env(monkeypatch):
    monkeypatch.setenv("FD_API_KEY", "env-a, env-b")
    assert collect_api_keys(["flag", "env-a"]) == ["flag", "env-a", "env-b"]
    checker = APIKeyChecker(["k1", "k2"])
    checker.check("Bearer k2")
    for header in (None, "", "Bearer", "Bearer wrong", "Basic k1", "k1"):
        with pytest.raises(APIError) as info:
            checker.check(header)
        assert info.value.http_status == 401
    APIKeyChecker([]).check(None)  # no keys configured: open


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("kv_cache_ratio", 1.5, "kv_cache_ratio: got 1.5; must be <= 1.0"),
        ("tensor_parallel_size", 0, "tensor_parallel_size: got 0; must be >= 1"),
        ("scheduler_name", "nosuch", ("scheduler_name: no scheduler 'nosuch' is registered; registered schedulers: "
                                      "global (fastdeploy-core), local (fastdeploy-core)")),
        ("speculative_config", {"method": "suffix"}, ("speculative_config.method: no speculative decoding method "
                                                       "'suffix' is registered; registered methods: draft_model "
                                                       "(fastdeploy-core), mtp (fastdeploy-core), ngram (fastdeploy-core)")),
        ("speculative_config", {"method": "mtp", "num_model_steps": 2},
         "speculative_config.num_model_steps: 2 MTP steps with num_speculative_tokens 1"),
        ("speculative_config", {"method": "ngram", "num_speculative_tokens": 0},
         "speculative_config.num_speculative_tokens: got 0; must be >= 1"),
    ],
)
def test_options_that_would_do_nothing_are_refused_from_flags_and_presets(tmp_path, key, value, says):
    """Refused the same way whether given as a flag or in a --config preset (no warning-and-run)."""
    with pytest.raises(ConfigError) as flag:
        build_configs({}, {key: value})
    assert says in flag.value.message
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml.safe_dump({key.replace("_", "-"): value}))
    with pytest.raises(ConfigError) as from_preset:
        build_configs(load_preset(str(preset)), {})
    assert from_preset.value.message == flag.value.message


def test_admission_429_past_concurrency_and_503_after_waiting():
    async def scenario():
        adm = Admission(max_concurrency=3, max_slots=2, max_waiting_time=0.2)
        a = await adm.admit(1)
        b = await adm.admit(1)
        with pytest.raises(APIError) as waited:  # no slot frees up within 0.2 s
            await adm.admit(1)
        assert waited.value.http_status == 503 and waited.value.code == "queue_timeout"
        assert adm.in_flight == 2 and adm.num_waiting == 0
        c_task = asyncio.create_task(adm.admit(1))  # waits for a slot
        await asyncio.sleep(0.01)
        with pytest.raises(APIError) as limited:
            await adm.admit(1)
        assert limited.value.http_status == 429
        a.release()
        a.release()  # idempotent
        c = await c_task
        assert adm.free_slots == 0
        for lease in (b, c):
            lease.release()
        assert adm.free_slots == 2 and adm.in_flight == 0
        with pytest.raises(InvalidRequestError):
            await adm.admit(3)  # more sequences than the engine can ever run

    asyncio.run(scenario())


def test_admission_waits_forever_with_negative_waiting_time():
    async def scenario():
        adm = Admission(max_concurrency=10, max_slots=1, max_waiting_time=-1)
        first = await adm.admit(1)
        waiter = asyncio.create_task(adm.admit(1))
        await asyncio.sleep(0.3)
        assert not waiter.done() and adm.num_waiting == 1
        first.release()
        (await waiter).release()
        assert adm.free_slots == 1

    asyncio.run(scenario())


def test_protocol_prompt_forms_and_limits():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    with pytest.raises(InvalidRequestError) as info:
        parse_body(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}], "stop": ' +
                   str(["s"] * 1000).replace("'", '"').encode() + b"}")
    assert info.value.param == "stop"
    req = parse_body(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
                     b' {"type": "text", "text": "b"}]}], "max_completion_tokens": 3, "max_tokens": 9}')
    assert req.messages[0].text() == "ab"
    assert req.requested_max_tokens() == 3
    image = parse_body(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}')
    with pytest.raises(InvalidRequestError, match="image_url"):
        image.messages[0].text()
