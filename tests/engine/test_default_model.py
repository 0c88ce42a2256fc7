"""The offline API on the real default model (SmolLM2-135M-Instruct GGUF).

One ``LLM()`` per module; the transformers reference comes from the session/disk-cached
helper of tests/support/reference.py so it is computed once.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest

from fastdeploy_core import LLM, SamplingParams
from fastdeploy_core.engine.output_processor import IncrementalDetokenizer
from fastdeploy_core.errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError
from tests.support.reference import CHAT_MESSAGES, NUM_GREEDY_TOKENS, transformers_smollm2_reference

pytestmark = pytest.mark.slow

ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024, num_gpu_blocks_override=64, max_num_seqs=16)


@pytest.fixture(scope="module")
def reference():
    return transformers_smollm2_reference()


def greedy(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 32)
    return SamplingParams(temperature=0, **kw)


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.core.block_manager
    assert not llm.engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])


def test_chat_answers_paris(llm, reference):
    out = llm.chat(CHAT_MESSAGES, greedy())[0]
    assert ANSWER in out.outputs.text  # FastDeploy style: outputs reads as the (only) choice
    assert out.outputs.text == out.outputs[0].text and out.outputs.finish_reason == "stop"
    assert out.outputs[0].finish_reason == "stop" and out.finished
    assert out.prompt_token_ids == reference["ids"].tolist()  # template + tokenizer agree with transformers
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time
    assert m.num_generated_tokens == len(out.outputs[0].token_ids)
    assert_all_blocks_free(llm)


def test_64_greedy_tokens_match_transformers(llm, reference):
    params = greedy(max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    out = llm.generate([reference["ids"].tolist()], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference["generated"].tolist()
    assert out.outputs[0].finish_reason == "length"


def test_batch_of_prompt_forms_and_prefix_hits(llm, reference):
    ids = reference["ids"].tolist()
    long = ids + reference["generated"].tolist()  # 101 tokens: one full 64-token block
    params = greedy(max_tokens=8, ignore_eos=True)
    alone = llm.generate(long, params, use_tqdm=False)[0]
    text_alone = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    outs = llm.generate([ids, "The capital of France is", long, [1, 2, 3, 4]], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == reference["generated"][:8].tolist()
    assert outs[1].prompt == "The capital of France is"
    assert outs[1].outputs[0].token_ids == text_alone.outputs[0].token_ids and outs[1].outputs[0].text
    assert outs[2].num_cached_tokens == 64 and outs[2].outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.engine.get_stats()["prefix_cache_hit_tokens"] >= 64
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "stop,include,expected",
    [
        ("France is", False, "The capital of "),  # spans several tokens
        ("France is", True, "The capital of France is"),
        ("apit", False, "The c"),  # inside one token
    ],
)
def test_stop_strings(llm, stop, include, expected):
    params = greedy(stop=[stop, "never-seen"], include_stop_str_in_output=include)
    rid = llm.engine.add_request(llm.tokenizer.apply_chat_template(CHAT_MESSAGES), params)
    deltas, final = [], None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            assert out.request_id == rid
            deltas.append(out.outputs[0].delta_text)
            final = out
    assert final.finished and final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert final.outputs[0].text == expected
    assert "".join(deltas) == expected
    if not include:
        assert all(stop not in d for d in deltas)
    assert_all_blocks_free(llm)


def test_skip_special_tokens_and_eos(llm):
    out = llm.chat(CHAT_MESSAGES, greedy(skip_special_tokens=False))[0].outputs[0]
    assert out.token_ids[-1] == 2 and out.text.endswith("<|im_end|>")
    # min_tokens keeps eos away: generation runs to max_tokens
    out = llm.chat(CHAT_MESSAGES, greedy(min_tokens=20, max_tokens=20))[0].outputs[0]
    assert len(out.token_ids) == 20 and 2 not in out.token_ids and out.finish_reason == "length"


def test_bad_words_and_stop_token_ids(llm):
    out = llm.chat(CHAT_MESSAGES, greedy(bad_words=["Paris"]))[0].outputs[0]
    assert "Paris" not in out.text and out.text.startswith("The capital of France is")
    paris = llm.tokenizer.encode(" Paris", add_special_tokens=False)
    assert len(paris) == 1
    out = llm.chat(CHAT_MESSAGES, greedy(stop_token_ids=paris))[0].outputs[0]
    assert out.token_ids[-1] == paris[0] and out.finish_reason == "stop" and out.stop_reason == paris[0]


def test_seeded_sampling_n_and_logprobs(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=12, n=2, logprobs=2)
    a = llm.chat(CHAT_MESSAGES, params)[0]
    b = llm.chat([CHAT_MESSAGES, [{"role": "user", "content": "Tell me a story."}]], [params, greedy()])[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len(a.outputs) == 2 and [o.index for o in a.outputs] == [0, 1]
    for o in a.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        for tok, lp in zip(o.token_ids, o.logprobs):
            assert next(iter(lp)) == tok and all(v <= 0 for v in lp.values()) and len(lp) >= 2
    assert_all_blocks_free(llm)


def test_incremental_detokenizer_multibyte(llm):
    tok = llm.tokenizer
    text = "Héllo wörld, 你好 🌍 — done."
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    pieces = [detok.push(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_bad_input_keeps_engine_serving(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate("", greedy())
    with pytest.raises(ContextLengthExceededError, match="max-model-len") as info:
        llm.generate([[5] * 2000], greedy())
    assert "2000" in str(info.value) and "1024" in str(info.value)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        llm.generate("hi", SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequestError, match="top_p"):
        llm.generate("hi", SamplingParams(top_p=0))
    # a bad prompt in a batch: nothing of the batch stays queued
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine prompt", ""], greedy())
    assert_all_blocks_free(llm)
    assert ANSWER in llm.chat(CHAT_MESSAGES, greedy())[0].outputs[0].text


def test_missing_model_path_is_typed():
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model="/no/such/model")
