"""Guided decoding without a model: the sampler's mask, the scheduler's wait for a grammar,
the compile worker and cache, and a matcher following (and rolling back) a request's tokens."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from fastdeploy_core.engine.block_manager import BlockManager
from fastdeploy_core.engine.request import Request
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.engine.scheduler import Scheduler
from fastdeploy_core.errors import InvalidRequestError
from fastdeploy_core.executor.sampler import Sampler, allowed_tokens
from fastdeploy_core.executor.step_io import ScheduledRequest
from fastdeploy_core.guided.params import GuidedDecodingParams

VOCAB = 70


def bitmask(allowed: list[int], vocab: int = VOCAB) -> np.ndarray:
    words = np.zeros((vocab + 31) // 32, dtype=np.int32)
    for t in allowed:
        words[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return words


def row(params: SamplingParams, mask=None, seed: int = 0) -> ScheduledRequest:
    return ScheduledRequest(
        request_id="r", all_token_ids=[1, 2], num_prompt_tokens=2, num_computed_tokens=0, num_new_tokens=2,
        block_table=[0], sampling_params=params, eos_token_ids=(0,), sample_seed=seed,
        samples=True, token_bitmask=mask,
    )


def test_bitmask_layout_round_trips_including_bit_31():
    allowed = [0, 5, 31, 32, 63, 69]
    assert np.nonzero(allowed_tokens(bitmask(allowed), VOCAB))[0].tolist() == allowed


def test_masked_rows_pick_only_allowed_tokens_and_unmasked_rows_are_untouched():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, VOCAB)).astype(np.float32)
    best = int(np.argmax(logits[0]))
    allowed = [t for t in (3, 40, 66) if t != best]
    greedy = SamplingParams(temperature=0)
    rows = [row(greedy, bitmask(allowed)), row(greedy), row(SamplingParams(temperature=1.0, seed=3), bitmask([7]))]
    assert not Sampler.all_plain_greedy(rows)  # the device argmax / greedy head would ignore the mask
    out = Sampler()(logits, rows)
    assert out.token_ids[0] == max(allowed, key=lambda t: logits[0, t])
    assert out.token_ids[1] == int(np.argmax(logits[1]))
    assert out.token_ids[2] == 7
    sampled = [Sampler()(logits, [row(SamplingParams(temperature=1.5), bitmask(allowed), seed=s)]).token_ids[0]
               for s in range(40)]
    assert set(sampled) <= set(allowed) and len(set(sampled)) > 1


def test_a_complete_grammar_ends_even_before_min_tokens():
    logits = np.zeros((1, VOCAB), dtype=np.float32)
    out = Sampler()(logits, [row(SamplingParams(temperature=0, min_tokens=5), bitmask([0]))])
    assert out.token_ids == [0]


class _Pending:
    """A grammar state that is compiling until ``done`` is set."""

    def __init__(self):
        self.done = False

    @property
    def ready(self):
        return self.done


def test_scheduler_runs_requests_behind_one_whose_grammar_compiles():
    sched = Scheduler(BlockManager(64, 4, True), max_num_seqs=8, max_num_batched_tokens=64)
    slow = Request("slow", [1, 2, 3], SamplingParams(max_tokens=4), max_total_tokens=10)
    slow.guided = _Pending()
    fast = Request("fast", [4, 5, 6], SamplingParams(max_tokens=4), max_total_tokens=10)
    sched.add_request(slow)
    sched.add_request(fast)
    assert [r.request_id for r, _ in sched.schedule().scheduled] == ["fast"]
    slow.guided.done = True
    assert [r.request_id for r, _ in sched.schedule().scheduled] == ["fast", "slow"]


def test_params_shape_checks_and_wire_round_trip():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        GuidedDecodingParams(regex="a", choice=["b"])
    with pytest.raises(InvalidRequestError, match="non-empty list"):
        GuidedDecodingParams(choice=[])
    params = SamplingParams(guided_decoding=GuidedDecodingParams(json='{"type": "object"}'))
    again = SamplingParams.from_dict(json.loads(json.dumps(params.to_dict())))
    assert again.guided_decoding == GuidedDecodingParams(json={"type": "object"})
    assert again.guided_decoding.key() == params.guided_decoding.key()


@pytest.fixture(scope="module")
def decoder():
    pytest.importorskip("llguidance")
    from fastdeploy_core.default_model import default_model_path
    from fastdeploy_core.guided.llguidance_backend import LLGuidanceBackend
    from fastdeploy_core.guided.manager import GuidedDecoder
    from fastdeploy_core.loader import resolve_model_source
    from fastdeploy_core.tokenizer import load_tokenizer

    source = resolve_model_source(default_model_path())
    tokenizer = load_tokenizer(source)
    threads = []

    def load():
        threads.append(threading.current_thread().name)
        return tokenizer

    dec = GuidedDecoder(LLGuidanceBackend, load, int(source.hf_config["vocab_size"]), tokenizer.eos_token_ids)
    dec.tokenizer, dec.load_threads = tokenizer, threads
    yield dec
    dec.close()


def test_compiles_in_the_worker_once_per_constraint_text(decoder):
    a = decoder.submit(GuidedDecodingParams(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = decoder.submit(GuidedDecodingParams(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}'))
    assert a is b
    a.result(timeout=60)
    assert decoder.load_threads and decoder.load_threads[0].startswith("fd-grammar-compile")
    with pytest.raises(InvalidRequestError, match="Invalid type"):
        decoder.submit(GuidedDecodingParams(json={"type": "objectx"})).result(timeout=60)


def test_matcher_follows_tokens_rolls_back_and_allows_eos_only_when_complete(decoder):
    tok = decoder.tokenizer
    eos = tok.eos_token_ids[0]
    state = decoder.new_request(GuidedDecodingParams(regex=r"ab(c|d)"))
    state.future.result(timeout=60)
    row = np.zeros(decoder.num_words, dtype=np.int32)

    def allowed(tokens):
        assert state.fill_bitmask(tokens, row)
        return set(np.nonzero(allowed_tokens(row, decoder.vocab_size))[0].tolist())

    start = allowed([])
    assert eos not in start
    ids = tok.encode("abc")
    done = allowed(ids)
    assert done == {eos}
    assert allowed(ids[:0]) == start  # rolled back to the start (a request that lost its tokens)
    assert state.num_accepted == 0
    wrong = tok.encode("x")
    state.sync(wrong)
    assert state.error is not None
