"""Speculative bookkeeping in the pure-Python scheduler, against a simulated target.

The simulated runner keeps a KV "cache" of token ids per block slot, written through the same
block tables and positions the real runner uses, and checks on every read that the slots of
every computed position hold that position's token: a rejected draft whose slot were counted
as computed, or a block freed while in use, would fail. The target is a pure function of the
context, so the tokens with speculation must equal the tokens without it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdeploy_core.engine.block_manager import BlockManager
from fastdeploy_core.engine.request import Request
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.engine.scheduler import Scheduler
from fastdeploy_core.executor.sampler import verify_drafts
from fastdeploy_core.spec_decode.ngram import lookup_ngram

EOS = 0
VOCAB = 50


def target(context: list[int]) -> int:
    """Mostly periodic (period 4, so prompt lookup guesses well), with a twist every 7th position."""
    n = len(context)
    base = context[-4] if n >= 4 else (context[-1] + 3) % VOCAB
    return (base + (n % 7 == 0)) % VOCAB or 1  # never EOS unless the test asks for it


class SimRunner:
    def __init__(self, bm: BlockManager, eos_after: dict[str, int] | None = None):
        self.slots = np.full(bm.num_blocks * bm.block_size, -1, dtype=np.int64)
        self.bs = bm.block_size
        self.eos_after = eos_after or {}

    def _token(self, rid: str, context: list[int], num_prompt: int) -> int:
        if len(context) - num_prompt == self.eos_after.get(rid, -1):
            return EOS
        return target(context)

    def execute(self, rows) -> tuple[list, list]:
        sampled, spec = [], []
        for r in rows:
            queries = r.query_token_ids()
            assert len(queries) == r.num_new_tokens
            # every computed position's slot holds its token (the KV the attention would read)
            for pos in range(r.num_computed_tokens):
                slot = r.block_table[pos // self.bs] * self.bs + pos % self.bs
                assert self.slots[slot] == r.all_token_ids[pos], f"{r.request_id}: stale KV at position {pos}"
            for j, tok in enumerate(queries):
                pos = r.num_computed_tokens + j
                self.slots[r.block_table[pos // self.bs] * self.bs + pos % self.bs] = tok
            context = r.all_token_ids[: r.num_computed_tokens] + queries
            if r.draft_token_ids:
                base = r.num_computed_tokens + 1
                targets = [self._token(r.request_id, context[: base + j], r.num_prompt_tokens)
                           for j in range(len(r.draft_token_ids) + 1)]
                out = verify_drafts(targets, r.draft_token_ids)
                sampled.append(out[0])
                spec.append(out)
            elif r.samples:
                sampled.append(self._token(r.request_id, context, r.num_prompt_tokens))
                spec.append(None)
            else:
                sampled.append(None)
                spec.append(None)
        return sampled, spec


def make_request(rid: str, prompt: list[int], max_tokens: int, temperature: float = 0.0, **kw) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=temperature, **kw),
        eos_token_ids=(EOS,),
        max_total_tokens=len(prompt) + max_tokens,
    )


def drive(requests, k: int, num_blocks: int = 64, block_size: int = 4, budget: int = 64, eos_after=None,
          prefix: bool = True):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=budget)
    runner = SimRunner(bm, eos_after)
    for req in requests:
        sched.add_request(req)
    steps = 0
    while sched.has_unfinished_requests():
        steps += 1
        assert steps < 5000
        batch = sched.schedule()
        if k:
            found = sched.draft_candidates(batch, k)
            drafts = {}
            for index, most in found:
                req = batch.scheduled[index][0]
                guess = lookup_ngram(np.asarray(req.all_token_ids), 1, 4, most)
                if guess:
                    drafts[index] = guess
            sched.add_drafts(batch, drafts)
            assert batch.num_scheduled_tokens <= budget
        sampled, spec = runner.execute(batch.runner_input().requests)
        sched.update(batch, sampled, spec)
        bm.check_invariants(list(sched.requests.values()))
        for req in sched.running:
            assert req.num_uncomputed_tokens >= 1 and not req.draft_token_ids
    assert bm.num_free_blocks == bm.num_blocks
    return sched, steps


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 14))] for _ in range(count)]


@pytest.mark.parametrize("num_blocks", [64, 12])  # 12 blocks of 4: preemption
def test_speculation_emits_the_tokens_of_one_token_steps(num_blocks):
    ps = prompts(0, 6) + [[5, 6, 7, 8] * 3]  # the last one repeats: shares blocks via the prefix cache
    ps.append(ps[-1] + [5])
    base = [make_request(f"r{i}", p, 20) for i, p in enumerate(ps)]
    spec = [make_request(f"r{i}", p, 20) for i, p in enumerate(ps)]
    _, steps_off = drive(base, k=0, num_blocks=num_blocks)
    on, steps_on = drive(spec, k=4, num_blocks=num_blocks)
    for a, b in zip(base, spec):
        assert b.output_token_ids == a.output_token_ids, a.request_id
        assert len(b.output_token_ids) == 20
    assert on.num_accepted_tokens > 0 and on.num_draft_tokens >= on.num_accepted_tokens
    assert sum(r.num_accepted_tokens for r in spec) == on.num_accepted_tokens
    assert steps_on < steps_off
    if num_blocks == 12:
        assert on.num_preemptions > 0


def test_eos_among_accepted_tokens_ends_the_request_there():
    p = [3, 4, 5, 6] * 3
    base, spec = make_request("a", p, 30), make_request("a", p, 30)
    drive([base], k=0, eos_after={"a": 9})
    drive([spec], k=6, eos_after={"a": 9})
    assert spec.output_token_ids == base.output_token_ids and spec.output_token_ids[-1] == EOS
    assert len(spec.output_token_ids) == 10 and spec.status.finish_reason == "stop"


def test_drafts_stop_at_the_length_limit_and_the_budget():
    req = make_request("a", [3, 4, 5, 6] * 3, 3)
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(req)
    batch = sched.schedule()
    assert sched.draft_candidates(batch, 8) == []  # still prefilling
    sched.update(batch, [7])
    batch = sched.schedule()
    assert sched.draft_candidates(batch, 8) == [(0, 1)]  # 2 tokens left: one draft plus the target's token
    # the token budget cuts drafts: the step may hold 2 tokens in all
    sched.max_num_batched_tokens = 2
    assert sched.add_drafts(batch, {0: [1, 2, 3]}) == 1
    assert batch.scheduled[0][1] == 2 and req.draft_token_ids == [1]
    rows = batch.runner_input().requests
    assert rows[0].samples and rows[0].query_token_ids() == [7, 1]


def test_drafts_never_preempt_and_take_only_free_blocks():
    a = make_request("a", [1, 2, 3], 20)
    b = make_request("b", [4, 5, 6], 20)
    bm = BlockManager(2, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(a)
    sched.add_request(b)
    batch = sched.schedule()
    sched.update(batch, [9, 9])
    batch = sched.schedule()  # each holds 4 tokens in its one block, both decode
    assert bm.num_free_blocks == 0
    assert sched.add_drafts(batch, {0: [1, 2], 1: [3]}) == 0
    assert not a.draft_token_ids and batch.num_scheduled_tokens == 2 and sched.num_preemptions == 0


def test_every_request_but_a_guided_one_may_speculate():
    """Greedy, sampled, logprobs, penalised and min_tokens requests speculate (the runner scores
    each draft position as the one-token step would); one under a grammar does not."""
    reqs = [
        make_request("greedy", [1, 2, 3], 8),
        make_request("hot", [1, 2, 3], 8, temperature=0.8, seed=1),
        make_request("logprobs", [1, 2, 3], 8, logprobs=2),
        make_request("penalty", [1, 2, 3], 8, repetition_penalty=1.2),
        make_request("min", [1, 2, 3], 8, min_tokens=2),
    ]
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    for r in reqs:
        sched.add_request(r)
    batch = sched.schedule()
    sched.update(batch, [5] * len(reqs))
    batch = sched.schedule()
    candidates = [batch.scheduled[i][0].request_id for i, _ in sched.draft_candidates(batch, 4)]
    assert candidates == ["greedy", "hot", "logprobs", "penalty", "min"]
    reqs[0].guided = object()  # a grammar's matcher: its mask is known for the next token only
    assert [batch.scheduled[i][0].request_id for i, _ in sched.draft_candidates(batch, 4)][0] == "hot"


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 8), num_blocks=st.integers(6, 40),
       budget=st.integers(8, 64), prefix=st.booleans())
def test_any_mix_of_prompts_budget_and_pool_gives_the_same_tokens(seed, k, num_blocks, budget, prefix):
    ps = prompts(seed, 5)
    base = [make_request(f"r{i}", p, 12) for i, p in enumerate(ps)]
    spec = [make_request(f"r{i}", p, 12) for i, p in enumerate(ps)]
    drive(base, k=0, num_blocks=num_blocks, budget=budget, prefix=prefix)
    drive(spec, k=k, num_blocks=num_blocks, budget=budget, prefix=prefix)
    for a, b in zip(base, spec):
        assert b.output_token_ids == a.output_token_ids
