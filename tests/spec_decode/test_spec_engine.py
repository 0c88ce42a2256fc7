"""Speculative decoding through the engine: tokens identical to speculation off.

A tiny random Llama (fast) covers preemption, prefix-cache hits, chunked prefill, n > 1 and
mixed batches at the engine-core level; the default model (slow) covers 16 batched chat and
raw prompts through ``LLM`` with stop strings.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest

from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.spec_decode.draft_model import DraftModelProposer
from tests.spec_decode.engine_runs import PROMPTS, batch, greedy, make_core, run, save_tiny_llama

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "min_ngram_size": 1, "max_ngram_size": 3}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny")), 0)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"num_gpu_blocks_override": 24},  # 96 slots for 11 sequences: preemption
        {"max_num_batched_tokens": 8},  # chunked prompts, and drafts cut by the step budget
        {"enable_prefix_caching": False},
    ],
    ids=["plain", "preemption", "chunked", "no-prefix-cache"],
)
def test_mixed_batches_give_the_tokens_of_speculation_off(tiny, settings):
    off = run(make_core(tiny, None, **settings), batch())
    core = make_core(tiny, NGRAM, **settings)
    on = run(core, batch())
    assert on == off
    stats = core.get_stats()
    assert stats["spec_decode_num_accepted_tokens_total"] > 0, stats
    assert stats["spec_decode_num_draft_tokens_total"] >= stats["spec_decode_num_accepted_tokens_total"]
    assert stats["generation_tokens_total"] == sum(len(t) for t in on.values())
    if "num_gpu_blocks_override" in settings:
        assert stats["num_preemptions"] > 0


def test_prefix_cache_hits_with_speculation(tiny):
    core = make_core(tiny, NGRAM)
    first = run(core, [("a", PROMPTS[3], greedy())])
    again = run(core, [("b", PROMPTS[3] + first[("a", 0)][:20], greedy(20))])
    ref = run(make_core(tiny, None), [("b", PROMPTS[3] + first[("a", 0)][:20], greedy(20))])
    assert again == ref
    assert core.get_stats()["prefix_cache_hit_tokens"] >= 32  # prompt + accepted output blocks were cached


def test_speculation_runs_beside_captured_decode_steps(tiny):
    """Captured graphs replay the one-token decode steps and the verify steps whose rows all
    carry as many drafts; ragged verify steps (ngram drafts differ in length) run eagerly."""
    eager = run(make_core(tiny, NGRAM, enforce_eager=True), batch())
    core = make_core(tiny, NGRAM)
    assert run(core, batch()) == eager
    assert core.config_info()["speculative_config"] == NGRAM


def test_ngram_verify_steps_of_one_sequence_replay_captured_graphs(tiny):
    """At batch 1 every verify step is uniform: the target replays a (1, 1 + k) graph for the
    steps with k drafts, and the tokens are those of speculation off and of eager verify steps."""
    requests = [("a", PROMPTS[3], greedy(60))]
    off = run(make_core(tiny, None), requests)
    assert run(make_core(tiny, NGRAM, enforce_eager=True), requests) == off
    core = make_core(tiny, NGRAM)
    assert run(core, requests) == off
    replays = core.runner.graphs.replays
    assert replays[(1, 5)] > 0 and replays[(1, 1)] > 0, dict(replays)
    assert core.get_stats()["spec_decode_num_draft_tokens_total"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec, least_accepted",
    [
        ({"method": "ngram", "num_speculative_tokens": 4}, 20),
        # a self-draft: the default model's own GGUF loaded as wint4
        ({"method": "draft_model", "num_speculative_tokens": 3, "quantization": "wint4"}, 200),
    ],
    ids=["ngram", "draft_model"],
)
def test_default_model_16_chat_and_raw_requests_match_speculation_off(spec, least_accepted):
    from fastdeploy_core import LLM

    text = ("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
            "for i in range(10):\n    print(i, fib(i))\n")
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": f"Rewrite this code with a docstring added:\n{text}"}],
        [{"role": "user", "content": "Repeat exactly: the cat sat on the mat, the cat sat on the mat."}],
        [{"role": "user", "content": "List the days of the week."}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "user", "content": "Explain what a hash map is in two sentences."}],
        [{"role": "user", "content": "Translate to French: good morning, my friend."}],
        [{"role": "user", "content": "Count from 1 to 20 separated by commas."}],
    ]
    raws = [
        text, "The capital of France is", "1, 2, 3, 4, 5, 6, 7, 8,", "Once upon a time",
        "A B C D E F G A B C D", "import numpy as np\n\n", text + "\n# The same code again:\n", "Q: What is 2+2?\nA:",
    ]
    params = SamplingParams(temperature=0, max_tokens=48)
    stop = SamplingParams(temperature=0, max_tokens=48, stop=["fib(3)"])
    outs = {}
    for name, on in (("off", None), ("on", spec)):
        llm = LLM(max_model_len=1024, num_gpu_blocks_override=64, max_num_seqs=16, speculative_config=on)
        got = [o.outputs[0].token_ids for o in llm.chat(chats, params, use_tqdm=False)]
        got += [o.outputs[0].token_ids for o in llm.generate(raws, params, use_tqdm=False)]
        got.append(llm.generate(text, stop, use_tqdm=False)[0].outputs[0].text)
        outs[name] = got
        if on:
            stats = llm.engine.get_stats()
            assert stats["spec_decode_num_accepted_tokens_total"] > least_accepted, stats
            if isinstance(llm.engine.core.proposer, DraftModelProposer):
                proposer = llm.engine.core.proposer
                assert proposer.num_free_blocks == proposer.num_blocks  # every request's draft blocks freed
        llm.close()
    assert outs["on"] == outs["off"]


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size(tiny):
    """vLLM's ``disable_by_batch_size``: with 5 greedy requests running and a limit of 2, no
    step carries drafts until at most 2 still run; then speculation resumes. Tokens unchanged."""
    reqs = [(f"g{i}", p, greedy(40 if i == 0 else 8)) for i, p in enumerate(PROMPTS)]
    off = run(make_core(tiny, None), reqs)
    core = make_core(tiny, {**NGRAM, "disable_by_batch_size": 2})
    drafted_at = []
    original = core.proposer.propose

    def propose(asks):
        drafted_at.append(core.scheduler.num_running)
        return original(asks)

    core.proposer.propose = propose
    assert run(core, reqs) == off
    assert drafted_at and max(drafted_at) <= 2, drafted_at
    assert core.config_info()["speculative_config"]["disable_by_batch_size"] == 2
    unlimited = make_core(tiny, NGRAM)
    seen = []
    original_unlimited = unlimited.proposer.propose
    unlimited.proposer.propose = lambda asks: seen.append(unlimited.scheduler.num_running) or original_unlimited(asks)
    run(unlimited, reqs)
    assert max(seen) == 5  # without the limit the same batch drafts at full size
