"""Sampled requests speculate and keep their tokens.

The sampler draws the token at output position ``n`` of a request with a uniform number that is
a function of the request's seed and ``n`` (``position_uniform``), so a drafted token is kept
exactly when it is the token one-token-per-step sampling draws there. Speculation therefore
leaves every sampled request's tokens as they are without it (the strongest form of "the
distribution is preserved"), and what remains to check is that the position-keyed draws are
an unbiased sampler of the filtered distribution.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import pytest

from fastdeploy_core.engine.request import Request
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.executor.sampler import Sampler, position_uniform
from tests.spec_decode.engine_runs import PROMPTS, make_core, run, save_tiny_llama

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "min_ngram_size": 1, "max_ngram_size": 3}
SELF_DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "quantization": "wint8"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_sampled")), 0)


def sampled_batch() -> list:
    """Only sampled requests: seeded and not, top-k / top-p / min-p, n=2, one nearly greedy."""
    reqs = []
    for i, p in enumerate(PROMPTS):
        reqs.append((f"s{i}", p, SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=32,
                                                 ignore_eos=True)))
    reqs.append(("cold", PROMPTS[3], SamplingParams(temperature=0.05, seed=5, max_tokens=40, ignore_eos=True)))
    reqs.append(("topk", PROMPTS[0], SamplingParams(temperature=1.0, top_k=5, min_p=0.05, seed=9, max_tokens=24,
                                                     ignore_eos=True)))
    reqs.append(("unseeded", PROMPTS[1], SamplingParams(temperature=0.7, max_tokens=24, ignore_eos=True)))
    reqs.append(("n2", PROMPTS[4], SamplingParams(temperature=0.6, n=2, seed=3, max_tokens=24, ignore_eos=True)))
    return reqs


@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT], ids=["ngram", "self_draft_wint8"])
@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 8}], ids=["plain", "chunked"])
def test_sampled_requests_speculate_and_keep_their_tokens(tiny, spec, settings):
    off = run(make_core(tiny, None, **settings), sampled_batch())
    core = make_core(tiny, spec, **settings)
    on = run(core, sampled_batch())
    assert on == off
    stats = core.get_stats()
    # every request here samples, so every draft scored was a sampled row's
    assert stats["spec_decode_num_draft_tokens_total"] > 0, stats
    if spec["method"] == "draft_model":  # the target's own weights guess right most of the time
        assert stats["spec_decode_num_accepted_tokens_total"] > 0, stats
    assert stats["generation_tokens_total"] == sum(len(t) for t in on.values())


def test_a_seeds_tokens_do_not_depend_on_the_batch_or_on_speculation(tiny):
    alone = run(make_core(tiny, NGRAM), [sampled_batch()[0]])
    batched = run(make_core(tiny, NGRAM), sampled_batch())
    assert alone[("s0", 0)] == batched[("s0", 0)]


def _request(params: SamplingParams, seed: int) -> Request:
    req = Request("r", [3, 4], params, eos_token_ids=(0,), max_total_tokens=100)
    req.sample_seed = seed
    return req


def test_position_keyed_draws_sample_the_filtered_distribution():
    """Chi-square goodness of fit of 40,000 draws (400 seeds x 100 positions) against the
    softmax of the logits at temperature 0.7. The critical value at 7 degrees of freedom and
    p = 0.001 is 24.32; a 5 % relative distortion of the most likely token's probability (0.32
    -> 0.336, the rest scaled down) gives an expected statistic of about 48, so the test fails
    such a sampler with power above 0.99."""
    logits = np.log(np.array([0.05, 0.25, 0.1, 0.2, 0.05, 0.15, 0.15, 0.05], dtype=np.float64))
    probs = np.exp(logits / 0.7)
    probs /= probs.sum()
    params = SamplingParams(temperature=0.7)
    sampler = Sampler()
    counts = np.zeros(len(probs))
    row = logits.astype(np.float32)
    for seed in range(400):
        req = _request(params, seed)
        for position in range(100):
            counts[sampler.sample_row(row, req, position)] += 1
    n = counts.sum()
    chi2 = float(((counts - n * probs) ** 2 / (n * probs)).sum())
    assert chi2 < 24.32, (chi2, counts / n, probs)


def test_position_uniform_is_a_function_of_seed_and_position():
    assert position_uniform(7, 3) == position_uniform(7, 3)
    draws = {position_uniform(7, p) for p in range(50)} | {position_uniform(s, 3) for s in range(50)}
    assert len(draws) == 99  # (7, 3) is in both sets
    assert all(0.0 <= u < 1.0 for u in draws)


def penalised_batch() -> list:
    """Penalties, bad words and min_tokens: each draft position is scored with the drafts before
    it counted as output."""
    return [
        ("rep", PROMPTS[3], SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=32, ignore_eos=True)),
        ("freq", PROMPTS[0], SamplingParams(temperature=0.7, seed=4, frequency_penalty=0.8, presence_penalty=0.4,
                                            max_tokens=32, ignore_eos=True)),
        ("bad", PROMPTS[1], SamplingParams(temperature=0, bad_words_token_ids=[[86], [27, 124]], max_tokens=24,
                                           ignore_eos=True)),
        ("min", PROMPTS[4], SamplingParams(temperature=0, min_tokens=6, stop_token_ids=[99, 121], max_tokens=24)),
    ]


@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT], ids=["ngram", "self_draft_wint8"])
def test_penalised_requests_speculate_and_keep_their_tokens(tiny, spec):
    off = run(make_core(tiny, None), penalised_batch())
    core = make_core(tiny, spec)
    on = run(core, penalised_batch())
    assert on == off
    stats = core.get_stats()
    assert stats["spec_decode_num_draft_tokens_total"] > 0, stats
    if spec["method"] == "draft_model":
        assert stats["spec_decode_num_accepted_tokens_total"] > 0, stats


def run_outputs(core, requests) -> dict:
    """Like ``run``, keeping each step's EngineCoreOutput (tokens and their logprobs)."""
    from fastdeploy_core.engine.outputs import EngineCoreRequest

    for rid, prompt, params in requests:
        core.add_request(EngineCoreRequest(rid, prompt, params))
    tokens: dict = {}
    logprobs: dict = {}
    while core.has_unfinished_requests():
        for out in core.step():
            key = (out.request_id, out.index)
            tokens.setdefault(key, []).extend(out.new_token_ids)
            assert out.new_logprobs is not None and len(out.new_logprobs) == len(out.new_token_ids)
            logprobs.setdefault(key, []).extend(out.new_logprobs)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return {"tokens": tokens, "logprobs": logprobs}


def test_logprobs_requests_speculate_with_one_entry_per_emitted_token(tiny):
    reqs = [
        ("lg", PROMPTS[3], SamplingParams(temperature=0, logprobs=3, max_tokens=24, ignore_eos=True)),
        ("ls", PROMPTS[0], SamplingParams(temperature=0.8, seed=2, logprobs=2, max_tokens=24, ignore_eos=True)),
        ("stop", PROMPTS[1], SamplingParams(temperature=0, logprobs=1, stop_token_ids=[99], max_tokens=24)),
    ]
    off = run_outputs(make_core(tiny, None), reqs)
    core = make_core(tiny, SELF_DRAFT)
    on = run_outputs(core, reqs)
    assert on["tokens"] == off["tokens"]
    assert core.get_stats()["spec_decode_num_accepted_tokens_total"] > 0
    for key, entries in off["logprobs"].items():
        got = on["logprobs"][key]
        assert len(got) == len(entries) == len(off["tokens"][key])
        for token, want, have in zip(off["tokens"][key], entries, got):
            assert token in have and set(have) == set(want), (key, want, have)
            assert all(abs(have[t] - want[t]) < 1e-4 for t in want), (key, want, have)
