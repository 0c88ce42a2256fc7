"""The engine on tiny random Llama checkpoints against transformers, and against itself.

Each checkpoint is written as safetensors by transformers; greedy tokens must match
transformers' ``generate`` exactly, and must not change with batching, chunked prefill,
prefix-cache hits or preemption. Seeds, stop tokens, min_tokens, n>1, penalties, bad words,
logprobs and bad input are checked at the engine-core level (no tokenizer needed).
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import pytest

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.engine.engine_core import MIX_PREFILL_DECODE_ENV, PROMPT_STEP_TARGET_ENV, EngineCore
from fastdeploy_core.engine.outputs import EngineCoreRequest
from fastdeploy_core.testing.engine_run import run_to_end
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    ModelLoadError,
    OutOfKVCacheError,
    UnsupportedArchitectureError,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MAX_NEW = 12
PROMPTS = [
    [5, 9, 17, 33, 2, 7, 100, 64, 3],
    [5, 9, 17, 33, 2, 7, 100, 64, 3, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],  # shares 9 tokens
    [1],
    [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110],
    [12, 12, 12, 12, 30],
]

CONFIGS = {
    # GQA, llama3 rope scaling, untied head
    "gqa_llama3_untied": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    # MHA, linear rope scaling, tied embeddings
    "mha_linear_tied": {
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
}


def _save_tiny(path: str, extra: dict) -> None:
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=256,
        initializer_range=0.3,  # peaky logits: no near-ties between float32 stacks
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **extra,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def _hf_greedy(model, prompt: list[int], max_new: int, **kw) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0, **kw
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    """(model path, transformers model, HF greedy tokens per prompt)."""
    path = str(tmp_path_factory.mktemp(request.param))
    model = _save_tiny(path, CONFIGS[request.param])
    refs = [_hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    return path, model, refs


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gqa"))
    model = _save_tiny(path, CONFIGS["gqa_llama3_untied"])
    return path, model


def make_core(path: str, **kw) -> EngineCore:
    settings = {"model": path, "max_model_len": 128, "block_size": 4, "num_gpu_blocks_override": 256}
    settings.update(kw)
    return EngineCore(EngineArgs.create(**settings))


def greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(core: EngineCore, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Submit everything, step to the end; {(request id, index): EngineCoreOutput list}."""
    return run_to_end(core, requests, key=lambda out: (out.request_id, out.index), outputs=True)


def tokens(outs: dict, rid: str, index: int = 0) -> list[int]:
    return [t for o in outs[(rid, index)] for t in o.new_token_ids]


def test_greedy_alone_matches_transformers(tiny):
    path, _, refs = tiny
    core = make_core(path)
    for i, prompt in enumerate(PROMPTS):
        outs = run(core, [(f"r{i}", prompt, greedy())])
        assert tokens(outs, f"r{i}") == refs[i], f"prompt {i}"
        last = outs[(f"r{i}", 0)][-1]
        assert last.finished and last.finish_reason == "length"


@pytest.mark.parametrize(
    "settings",
    [
        {},  # all batched together
        {"max_num_batched_tokens": 5},  # chunked prefill in small pieces
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 128},
        {"enable_prefix_caching": False, "max_num_seqs": 2},
    ],
    ids=["batched", "chunked", "no_chunking", "no_prefix_cache_2_seqs"],
)
def test_batched_and_chunked_match_alone(tiny, settings):
    path, _, refs = tiny
    core = make_core(path, **settings)
    outs = run(core, [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)])
    for i in range(len(PROMPTS)):
        assert tokens(outs, f"r{i}") == refs[i], f"prompt {i}"


def test_prefix_cache_hits_give_same_tokens(tiny):
    path, _, refs = tiny
    core = make_core(path)
    first = run(core, [("a", PROMPTS[1], greedy())])
    assert first[("a", 0)][0].num_cached_tokens == 0
    again = run(core, [("b", PROMPTS[1], greedy()), ("c", PROMPTS[0], greedy())])
    assert tokens(again, "b") == refs[1] and tokens(again, "c") == refs[0]
    assert again[("b", 0)][0].num_cached_tokens == 20  # 5 full blocks of 4 (the last token is recomputed)
    assert again[("c", 0)][0].num_cached_tokens == 8  # the shared 9-token prefix: 2 full blocks
    stats = core.get_stats()
    assert stats["prefix_cache_hit_tokens"] >= 28 and stats["prefix_cache_hits"] >= 2


def test_preemption_recomputes_to_same_tokens(tiny):
    path, _, refs = tiny
    # 10 blocks of 4 = 40 slots: room for one max_model_len=40 sequence; five requests must preempt
    core = make_core(path, num_gpu_blocks_override=10, max_model_len=40)
    outs = run(core, [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)])
    assert core.get_stats()["num_preemptions"] > 0
    for i in range(len(PROMPTS)):
        assert tokens(outs, f"r{i}") == refs[i], f"prompt {i}"


def test_penalties_and_bad_words_match_transformers(gqa_model):
    path, model = gqa_model
    core = make_core(path)
    prompt = PROMPTS[4]
    ref = _hf_greedy(model, prompt, MAX_NEW, repetition_penalty=1.5)
    assert tokens(run(core, [("rep", prompt, greedy(repetition_penalty=1.5))]), "rep") == ref
    plain = _hf_greedy(model, prompt, MAX_NEW)
    banned = [[plain[0]], [plain[1], plain[2]]]
    ref = _hf_greedy(model, prompt, MAX_NEW, bad_words_ids=banned)
    got = tokens(run(core, [("bad", prompt, greedy(bad_words_token_ids=banned))]), "bad")
    assert got == ref and got != plain


def test_frequency_and_presence_penalty_change_tokens(gqa_model):
    path, _ = gqa_model
    core = make_core(path)
    prompt = PROMPTS[4]
    plain = tokens(run(core, [("p", prompt, greedy(max_tokens=24))]), "p")
    assert len(set(plain)) < len(plain)  # greedy repeats itself on this prompt
    pen = tokens(run(core, [("f", prompt, greedy(max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0))]), "f")
    assert pen != plain and len(set(pen)) > len(set(plain))


def test_stop_token_ids_and_min_tokens(gqa_model):
    path, _ = gqa_model
    core = make_core(path)
    prompt = PROMPTS[0]
    plain = tokens(run(core, [("p", prompt, greedy())]), "p")
    stop = plain[3]
    first = plain.index(stop)
    outs = run(core, [("s", prompt, greedy(stop_token_ids=[stop]))])
    assert tokens(outs, "s") == plain[: first + 1]
    last = outs[("s", 0)][-1]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    # min_tokens masks the stop token until enough tokens exist
    outs = run(core, [("m", prompt, greedy(stop_token_ids=[stop], min_tokens=first + 2))])
    got = tokens(outs, "m")
    assert len(got) >= first + 2 and stop not in got[: first + 2]


def test_seed_same_tokens_alone_and_batched(gqa_model):
    path, _ = gqa_model
    core = make_core(path)
    sampled = SamplingParams(temperature=1.5, top_k=50, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = tokens(run(core, [("a", PROMPTS[0], sampled)]), "a")
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    outs = run(core, [("x", PROMPTS[1], noise), ("b", PROMPTS[0], sampled), ("y", PROMPTS[3], greedy())])
    assert tokens(outs, "b") == alone
    other = tokens(
        run(
            core,
            [
                (
                    "c",
                    PROMPTS[0],
                    SamplingParams(temperature=1.5, top_k=50, top_p=0.95, seed=99, max_tokens=16, ignore_eos=True),
                )
            ],
        ),
        "c",
    )
    assert other != alone


def test_n_choices_follow_seed_plus_index(gqa_model):
    path, _ = gqa_model
    core = make_core(path)
    params = SamplingParams(n=3, temperature=2.0, seed=7, max_tokens=10, ignore_eos=True)
    outs = run(core, [("n", PROMPTS[0], params)])
    choices = [tokens(outs, "n", i) for i in range(3)]
    assert len({tuple(c) for c in choices}) == 3
    single = SamplingParams(temperature=2.0, seed=8, max_tokens=10, ignore_eos=True)
    assert tokens(run(core, [("one", PROMPTS[0], single)]), "one") == choices[1]


def test_logprobs_and_prompt_logprobs_match_transformers(gqa_model):
    path, model = gqa_model
    core = make_core(path)
    prompt = PROMPTS[0]
    outs = run(core, [("lp", prompt, greedy(max_tokens=4, logprobs=3, prompt_logprobs=2))])
    got = tokens(outs, "lp")
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got])).logits[0].double()
    ref = torch.log_softmax(logits, dim=-1).numpy()
    steps = [lp for o in outs[("lp", 0)] for lp in o.new_logprobs]
    assert len(steps) == 4
    for k, lp in enumerate(steps):
        row = ref[len(prompt) - 1 + k]
        assert next(iter(lp)) == got[k]  # the sampled token comes first
        top = list(np.argsort(-row)[:3])
        assert list(lp)[:1] == [top[0]] and set(top) <= set(lp)  # greedy: sampled is rank 1
        for tok, value in lp.items():
            assert abs(value - row[tok]) < 1e-3
    prompt_lps = outs[("lp", 0)][0].prompt_logprobs
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = prompt_lps[pos]
        assert next(iter(entry)) == prompt[pos]
        assert abs(entry[prompt[pos]] - ref[pos - 1][prompt[pos]]) < 1e-3
        assert len(entry) >= 2


def test_abort_frees_blocks_immediately(gqa_model):
    path, _ = gqa_model
    core = make_core(path)
    core.add_request(EngineCoreRequest("long", PROMPTS[3], greedy(max_tokens=50)))
    core.add_request(EngineCoreRequest("n2", PROMPTS[1], SamplingParams(n=2, temperature=1.0, max_tokens=50)))
    core.step()
    core.step()
    assert core.block_manager.num_free_blocks < core.block_manager.num_blocks
    core.abort_requests(["long", "n2"])
    assert not core.has_unfinished_requests()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    assert core.step() == []


def test_bad_input_is_typed_and_engine_keeps_serving(gqa_model):
    path, model = gqa_model
    core = make_core(path)
    cases = [
        (lambda: core.add_request(EngineCoreRequest("e", [], greedy())), InvalidRequestError, "empty"),
        (
            lambda: core.add_request(EngineCoreRequest("l", [1] * 128, greedy())),
            ContextLengthExceededError,
            "--max-model-len",
        ),
        (lambda: core.add_request(EngineCoreRequest("v", [1, 500], greedy())), InvalidRequestError, "vocabulary"),
        (lambda: SamplingParams(max_tokens=0), InvalidRequestError, "max_tokens"),
        (lambda: SamplingParams(temperature=-1), InvalidRequestError, "temperature"),
        (lambda: SamplingParams(top_p=1.5), InvalidRequestError, "top_p"),
        (lambda: SamplingParams(top_k=-3), InvalidRequestError, "top_k"),
        (lambda: SamplingParams(min_p=2), InvalidRequestError, "min_p"),
        (lambda: SamplingParams(presence_penalty=3), InvalidRequestError, "presence_penalty"),
        (lambda: SamplingParams(repetition_penalty=0), InvalidRequestError, "repetition_penalty"),
        (lambda: SamplingParams(logprobs=21), InvalidRequestError, "logprobs"),
        (lambda: SamplingParams(n=0), InvalidRequestError, "n"),
        (lambda: SamplingParams(max_tokens=2, min_tokens=3), InvalidRequestError, "min_tokens"),
        (lambda: SamplingParams(stop=[""]), InvalidRequestError, "stop"),
    ]
    for call, error, words in cases:
        with pytest.raises(error) as info:
            call()
        assert words in str(info.value)
        assert info.value.http_status == 400
    err = pytest.raises(ContextLengthExceededError, core.add_request, EngineCoreRequest("l", [1] * 200, greedy())).value
    assert "200" in str(err) and "128" in str(err)
    assert not core.has_unfinished_requests()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    outs = run(core, [("ok", PROMPTS[0], greedy())])
    assert tokens(outs, "ok") == _hf_greedy(model, PROMPTS[0], MAX_NEW)


def test_bad_engine_settings_are_typed(gqa_model, tmp_path):
    path, _ = gqa_model
    with pytest.raises(OutOfKVCacheError) as info:
        make_core(path, num_gpu_blocks_override=4, max_model_len=128)
    msg = str(info.value)
    assert "32 blocks" in msg and "--max-model-len to at most 16" in msg
    with pytest.raises(ModelLoadError, match="does not exist"):
        make_core(str(tmp_path / "nowhere"))
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"], "vocab_size": 8}')
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        make_core(str(odd), model_impl="fastdeploy")
    with pytest.raises(ModelLoadError) as info:  # auto: native, else the PaddleFormers fallback
        make_core(str(odd))
    assert "NoSuchForCausalLM" in str(info.value)


@pytest.mark.parametrize("mix", ["1", "0"], ids=["mixed_steps", "unmixed_steps"])
def test_requests_joining_mid_flight_match_alone(tiny, mix, monkeypatch):
    """Continuous batching: prompts arrive while others decode (in one step, or in alternate ones)."""
    monkeypatch.setenv(MIX_PREFILL_DECODE_ENV, mix)
    path, _, refs = tiny
    core = make_core(path, max_num_batched_tokens=7)
    assert core.scheduler.mix_prefill_decode == (mix == "1")
    got: dict[str, list[int]] = {}
    pending = [(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    steps = 0
    while pending or core.has_unfinished_requests():
        if pending and steps % 3 == 0:
            rid, prompt = pending.pop(0)
            core.add_request(EngineCoreRequest(rid, prompt, greedy()))
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
    for i in range(len(PROMPTS)):
        assert got[f"r{i}"] == refs[i], f"prompt {i}"
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_prompt_steps_are_capped_from_measured_time(gqa_model, monkeypatch):
    path, _ = gqa_model
    monkeypatch.delenv(PROMPT_STEP_TARGET_ENV, raising=False)
    core = make_core(path, max_num_batched_tokens=100)  # the smallest capped step is then 100 tokens
    assert core.scheduler.prompt_token_cap == core.prompt_sizer.min_tokens == 100  # nothing measured yet
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 100, size=70).tolist() for _ in range(2)]
    outs = run(core, [(f"r{i}", p, greedy(4)) for i, p in enumerate(prompts)])
    assert all(outs[(f"r{i}", 0)][-1].finished for i in range(2))
    assert core.prompt_sizer.seconds_per_token > 0  # a prompt step was measured
    assert core.scheduler.prompt_token_cap == core.prompt_sizer.cap
    monkeypatch.setenv(PROMPT_STEP_TARGET_ENV, "0")
    assert make_core(path).scheduler.prompt_token_cap is None


def test_two_engines_in_one_process_each_run_their_own_ops(gqa_model):
    """An int8-KV engine built before a float one keeps working after it: each step installs
    its own ops table (the float engine's would write float rows into the int8 caches)."""
    path, _ = gqa_model
    prompt = [5, 9, 17, 33, 2, 7]
    int8_core = make_core(path, kv_cache_dtype="int8")
    alone = tokens(run(int8_core, [("a", prompt, greedy())]), "a")
    float_core = make_core(path)
    float_tokens = tokens(run(float_core, [("f", prompt, greedy())]), "f")
    assert tokens(run(int8_core, [("b", prompt, greedy())]), "b") == alone
    assert tokens(run(float_core, [("g", prompt, greedy())]), "g") == float_tokens
    # kv_cache_dtype is honoured: the int8 engine's cache holds int8 codes (a quarter of the
    # float bytes plus scales) and they were written; the float engine's stays float32.
    from fastdeploy_core.quantization.kv_cache import QuantizedKVCache

    k_int8, k_float = int8_core.runner.kv_caches[0][0], float_core.runner.kv_caches[0][0]
    assert isinstance(k_int8, QuantizedKVCache) and str(k_int8.data.dtype) == "paddle.int8"
    assert str(k_float.dtype) == "paddle.float32"
    assert np.abs(k_int8.data.numpy()).max() > 0
    assert int8_core.runner.bytes_per_block < float_core.runner.bytes_per_block / 3
    # int8 rounding this small leaves the greedy tokens of the float cache
    assert alone == float_tokens


def test_kv_cache_memory_is_exact_and_refused_when_it_cannot_hold_one_sequence(gqa_model, caplog):
    path, _ = gqa_model
    per_block = make_core(path).runner.bytes_per_block
    with caplog.at_level(logging.INFO, logger="fastdeploy_core.executor.model_runner"):
        core = make_core(path, num_gpu_blocks_override=None, kv_cache_memory=40 * per_block + 7)
    assert core.runner.num_blocks == 40 and core.block_manager.num_blocks == 40
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert lines == [
        f"KV cache: 40 blocks of 4 tokens (float32, {40 * per_block / (1 << 20):.1f} MiB, 160 tokens, 1.2 sequences of "
        f"max_model_len 128), from --kv-cache-memory {40 * per_block + 7} bytes"
    ]
    with pytest.raises(OutOfKVCacheError) as info:  # 128 tokens need 32 blocks
        make_core(path, num_gpu_blocks_override=None, kv_cache_memory=31 * per_block)
    assert info.value.param == "kv_cache_memory"
    assert f"--kv-cache-memory {32 * per_block} (bytes) or more" in str(info.value)
    with pytest.raises(OutOfKVCacheError, match="--kv-cache-memory .* MiB is more than the cpu device has"):
        make_core(path, num_gpu_blocks_override=None, kv_cache_memory="100TiB")
