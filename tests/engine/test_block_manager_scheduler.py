"""Property tests of the pure-Python engine parts: block manager and scheduler."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdeploy_core.engine.block_manager import BlockManager
from fastdeploy_core.engine.request import Request, RequestStatus
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.engine.scheduler import Scheduler

EOS = 0


def make_request(rid: str, prompt: list[int], max_tokens: int, min_tokens: int = 0, priority: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens)
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=params,
        priority=priority,
        eos_token_ids=(EOS,),
        max_total_tokens=len(prompt) + max_tokens,
    )


def live(sched: Scheduler) -> list[Request]:
    return list(sched.requests.values())


def test_prefix_hit_shares_blocks_and_counts_hits():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(1, 11)), 4)
    assert bm.allocate(a, 10, bm.find_cached_blocks(a))
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    b = make_request("b", list(range(1, 11)) + [42], 4)
    hits = bm.find_cached_blocks(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, 11, hits)
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.prefix_hit_tokens == 8 and bm.prefix_query_tokens == 10 + 11
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])
    # freed cached blocks are revived by a later request with the same prefix
    c = make_request("c", list(range(1, 9)) + [7, 7], 4)
    assert len(bm.find_cached_blocks(c)) == 2


def test_lru_evicts_uncached_then_oldest_cached():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5], 1)
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)  # blocks 0,1 cached; block 2 partial
    bm.free(a)
    assert list(bm._free)[:2] == [2, 3]  # partial/unused first
    b = make_request("b", [9, 9, 9, 9, 9, 9, 9], 1)
    bm.allocate(b, 7)  # needs 4 blocks: evicts both cached blocks
    assert bm.find_cached_blocks(make_request("c", [1, 2, 3, 4, 5], 1)) == []
    bm.check_invariants([b])


def test_used_blocks_before_new_ones_and_new_ones_before_cached():
    """The committed KV memory grows only when no used block is free (see the module docstring),
    and a cached prefix survives while never-used blocks remain."""
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5], 1)
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)  # blocks 0, 1 cached; block 2 partial
    bm.free(a)
    assert bm.num_touched_blocks == 3
    for i in range(10):  # short requests one after another reuse the freed partial block
        r = make_request(f"r{i}", [7], 1)
        assert bm.allocate(r, 1)
        assert r.block_table == [2]
        bm.free(r)
    assert bm.num_touched_blocks == 3
    b = make_request("b", [9] * 6, 1)
    assert bm.allocate(b, 6)
    assert b.block_table == [2, 3, 4]  # never-used blocks before the cached prefix
    assert len(bm.find_cached_blocks(make_request("c", [1, 2, 3, 4, 5], 1))) == 2
    d = make_request("d", [8] * 6, 1)
    assert bm.allocate(d, 6)
    assert d.block_table == [5, 1, 0]  # then the cache, its newest-in-chain block first
    assert bm.num_touched_blocks == bm.num_blocks == 6
    bm.check_invariants([b, d])


def test_free_twice_is_detected():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = make_request("a", [1, 2, 3], 1)
    bm.allocate(a, 3)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(a)


def run_to_completion(sched: Scheduler, rng: random.Random, abort_prob: float, max_steps: int = 3000) -> dict:
    bm = sched.block_manager
    finished: dict[str, RequestStatus] = {}
    steps = 0
    while sched.has_unfinished_requests():
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
        decoding_before = {r.request_id for r in sched.running if r.num_uncomputed_tokens == 1}
        out = sched.schedule()
        assert out.num_scheduled_tokens <= sched.max_num_batched_tokens
        if not sched.mix_prefill_decode:  # a step is all decodes or all prompt work
            kinds = {r.request_id in decoding_before for r, _ in out.scheduled}
            assert len(kinds) <= 1, "prompt work and decodes in one step"
        assert len(sched.running) <= sched.max_num_seqs
        bm.check_invariants(live(sched))
        if out.is_empty:
            assert not sched.running, "running requests but nothing scheduled"
            assert not sched.waiting
            break
        for req, n in out.scheduled:
            assert len(req.block_table) * bm.block_size >= req.num_computed_tokens + n
        sampled = []
        for i, _ in enumerate(out.scheduled):
            sampled.append(rng.choice([EOS, 5, 6, 7]) if out.samples(i) else None)
        for req in sched.update(out, sampled):
            finished[req.request_id] = req.status
        if rng.random() < abort_prob and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            for req in sched.finish_requests([victim]):
                finished[req.request_id] = req.status
        bm.check_invariants(live(sched))
    return finished


request_spec = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 12),  # max tokens
    st.integers(0, 3),  # shared-prefix family
    st.integers(0, 2),  # priority
)


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(request_spec, min_size=1, max_size=12),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 6),
    policy=st.sampled_from(["fcfs", "priority"]),
    prefix=st.booleans(),
    chunked=st.booleans(),
    seed=st.integers(0, 2**16),
    abort_prob=st.sampled_from([0.0, 0.1]),
    mixed=st.booleans(),
    prompt_cap=st.one_of(st.none(), st.integers(1, 16)),
)
def test_every_request_finishes_and_no_block_leaks(
    specs, block_size, budget, max_num_seqs, policy, prefix, chunked, seed, abort_prob, mixed, prompt_cap
):
    rng = random.Random(seed)
    max_len = max(p + m for p, m, _, _ in specs)
    if not chunked:  # the config requires a budget that fits a whole max_model_len prompt
        budget = max(budget, max_len)
    # just enough blocks for one longest sequence, sometimes a few more: forces preemption
    num_blocks = -(-max_len // block_size) + rng.randint(0, 4)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    sched = Scheduler(
        bm, max_num_seqs, budget, enable_chunked_prefill=chunked, policy=policy, mix_prefill_decode=mixed
    )
    sched.prompt_token_cap = prompt_cap
    for i, (plen, mtok, family, prio) in enumerate(specs):
        prompt = [(family * 7 + j) % 11 + 1 for j in range(plen)]  # families share prefixes; no eos
        sched.add_request(make_request(f"r{i}", prompt, mtok, priority=prio))
    finished = run_to_completion(sched, rng, abort_prob)
    assert sorted(finished) == sorted(f"r{i}" for i in range(len(specs)))
    assert all(s.is_finished for s in finished.values())
    assert bm.num_free_blocks == num_blocks
    bm.check_invariants([])


def test_chunked_prefill_and_no_chunking():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, 4, 8, enable_chunked_prefill=True)
    req = make_request("a", list(range(1, 21)), 2)
    sched.add_request(req)
    chunks = []
    while True:
        out = sched.schedule()
        chunks.append(out.scheduled[0][1])
        token = 5 if out.samples(0) else None
        sched.update(out, [token])
        if token is not None:
            break
    assert chunks == [8, 8, 4]
    # without chunking, a prompt above the budget waits (config forbids that combination)
    sched2 = Scheduler(BlockManager(16, 4), 4, 8, enable_chunked_prefill=False)
    sched2.add_request(make_request("b", list(range(1, 21)), 2))
    assert sched2.schedule().is_empty


def test_preempts_newest_and_recomputes():
    bm = BlockManager(4, 2)  # 8 token slots
    sched = Scheduler(bm, 4, 64)
    old = make_request("old", [1, 2, 3], 4)
    new = make_request("new", [4, 5, 6], 4)
    sched.add_request(old)
    sched.add_request(new)
    out = sched.schedule()
    sched.update(out, [5, 5])
    preempted = []
    for _ in range(20):
        out = sched.schedule()
        preempted += [r.request_id for r in out.preempted]
        sched.update(out, [5 if out.samples(i) else None for i in range(len(out.scheduled))])
        if not sched.has_unfinished_requests():
            break
    assert preempted and set(preempted) == {"new"}
    assert new.num_preemptions >= 1 and new.num_output_tokens == 4 and old.num_output_tokens == 4
    assert bm.num_free_blocks == 4


def test_priority_policy_admits_lower_value_first():
    sched = Scheduler(BlockManager(32, 4), 1, 64, policy="priority")
    sched.add_request(make_request("low", [1, 2], 1, priority=5))
    sched.add_request(make_request("high", [1, 2], 1, priority=0))
    assert sched.schedule().scheduled[0][0].request_id == "high"


def test_min_tokens_defers_eos_and_stop_token_reason():
    sched = Scheduler(BlockManager(32, 4), 2, 64)
    req = make_request("a", [1, 2], 10, min_tokens=2)
    sched.add_request(req)
    for tok in (EOS, EOS):
        out = sched.schedule()
        done = sched.update(out, [tok])
    assert done == [req] and req.output_token_ids == [EOS, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED


def _step(sched: Scheduler, token: int = 5) -> list[tuple[str, int]]:
    out = sched.schedule()
    sched.update(out, [token if out.samples(i) else None for i in range(len(out.scheduled))])
    return [(r.request_id, n) for r, n in out.scheduled]


def test_unmixed_steps_alternate_prompts_and_decodes():
    sched = Scheduler(BlockManager(64, 4), 8, 64, mix_prefill_decode=False)
    sched.add_request(make_request("a", [1, 2, 3, 4], 10))
    sched.add_request(make_request("b", [1, 2, 3, 4, 5, 6], 10))
    assert _step(sched) == [("a", 4), ("b", 6)]  # nothing decodes yet: one prompt step
    sched.add_request(make_request("c", [7, 8, 9], 10))
    assert _step(sched) == [("a", 1), ("b", 1)]  # after a prompt step, the decodes ...
    assert _step(sched) == [("c", 3)]  # ... then the new prompt alone ...
    assert _step(sched) == [("a", 1), ("b", 1), ("c", 1)]  # ... then every decode together
    assert _step(sched) == [("a", 1), ("b", 1), ("c", 1)]  # no prompt waiting: decodes go on
    sched.add_request(make_request("d", [7, 8], 10))
    sched.add_request(make_request("e", [9, 9], 10))
    assert _step(sched) == [("d", 2), ("e", 2)]  # after a decode step, the waiting prompts


def test_unmixed_runs_decodes_when_no_prompt_can_start():
    # one sequence slot: the waiting prompt cannot be admitted, so decodes must not stall
    sched = Scheduler(BlockManager(64, 4), 1, 64, mix_prefill_decode=False)
    sched.add_request(make_request("a", [1, 2, 3], 3))
    sched.add_request(make_request("b", [4, 5, 6], 3))
    steps = [_step(sched) for _ in range(6)]
    assert steps == [[("a", 3)], [("a", 1)], [("a", 1)], [("b", 3)], [("b", 1)], [("b", 1)]]
    assert not sched.has_unfinished_requests()


def test_unmixed_chunked_prompt_alternates_with_decodes():
    sched = Scheduler(BlockManager(64, 4), 4, 8, mix_prefill_decode=False)
    sched.add_request(make_request("a", [1, 2], 20))
    _step(sched)
    sched.add_request(make_request("long", list(range(1, 21)), 2))
    assert _step(sched) == [("a", 1)]
    assert _step(sched) == [("long", 8)]
    assert _step(sched) == [("a", 1)]
    assert _step(sched) == [("long", 8)]
    assert _step(sched) == [("a", 1)]
    assert _step(sched) == [("long", 4)]  # its last chunk samples its first token
    assert _step(sched) == [("a", 1), ("long", 1)]


def test_mixed_steps_hold_prompts_and_decodes_together():
    sched = Scheduler(BlockManager(64, 4), 8, 64)  # the default: mixed
    sched.add_request(make_request("a", [1, 2, 3, 4], 10))
    _step(sched)
    sched.add_request(make_request("b", [5, 6, 7], 10))
    assert _step(sched) == [("a", 1), ("b", 3)]


def test_engine_mixes_only_for_ragged_attention(monkeypatch):
    from fastdeploy_core.engine.engine_core import MIX_PREFILL_DECODE_ENV, mixes_prefill_and_decode

    class PaddedOps:
        pass

    class RaggedOps:
        ragged_attention = True

    monkeypatch.delenv(MIX_PREFILL_DECODE_ENV, raising=False)
    assert not mixes_prefill_and_decode(PaddedOps())
    assert mixes_prefill_and_decode(RaggedOps())
    monkeypatch.setenv(MIX_PREFILL_DECODE_ENV, "1")
    assert mixes_prefill_and_decode(PaddedOps())
    monkeypatch.setenv(MIX_PREFILL_DECODE_ENV, "0")
    assert not mixes_prefill_and_decode(RaggedOps())


def test_prompt_token_cap_spreads_a_burst_over_steps():
    sched = Scheduler(BlockManager(64, 4), 8, 64, mix_prefill_decode=False)
    sched.prompt_token_cap = 8
    for k, rid in enumerate("abc"):
        sched.add_request(make_request(rid, [k + 1] * 6, 10))  # no shared prefix
    assert _step(sched) == [("a", 6), ("b", 2)]  # 8 prompt tokens; b is chunked
    assert _step(sched) == [("a", 1)]
    assert _step(sched) == [("b", 4), ("c", 4)]
    assert _step(sched) == [("a", 1), ("b", 1)]
    assert _step(sched) == [("c", 2)]


def test_prompt_token_cap_leaves_a_lone_request_alone():
    sched = Scheduler(BlockManager(64, 4), 8, 64, mix_prefill_decode=False)
    sched.prompt_token_cap = 8
    sched.add_request(make_request("a", list(range(1, 21)), 2))
    assert _step(sched) == [("a", 20)]


def test_prompt_token_cap_without_chunking_takes_the_first_prompt_whole():
    sched = Scheduler(BlockManager(64, 4), 8, 64, enable_chunked_prefill=False, mix_prefill_decode=False)
    sched.prompt_token_cap = 4
    sched.add_request(make_request("a", [1] * 6, 10))
    sched.add_request(make_request("b", [2] * 6, 10))
    assert _step(sched) == [("a", 6)]
    assert _step(sched) == [("a", 1)]
    assert _step(sched) == [("b", 6)]


def test_prompt_step_sizer_follows_measured_time():
    from fastdeploy_core.engine.engine_core import PromptStepSizer

    sizer = PromptStepSizer(target_s=0.5, min_tokens=64, max_tokens=2048, decode_ratio=4.0, smoothing=0.5)
    assert sizer.cap == 64  # nothing measured yet
    sizer.observe(prompt_tokens=10, total_tokens=10, seconds=1.0)  # too small a prompt step to measure
    assert sizer.cap == 64
    sizer.observe(prompt_tokens=100, total_tokens=100, seconds=0.2)  # 2 ms per token
    assert sizer.cap == 250
    sizer.observe(prompt_tokens=0, total_tokens=16, seconds=0.25)  # decode steps of 250 ms: 4 of them = 1 s
    assert sizer.cap == 500
    sizer.observe(prompt_tokens=100, total_tokens=100, seconds=0.6)  # slower now: 4 ms per token (average)
    assert sizer.cap == 250
    fast = PromptStepSizer(target_s=0.5, min_tokens=64, max_tokens=2048)
    fast.observe(prompt_tokens=100, total_tokens=100, seconds=0.001)
    assert fast.cap == 2048  # never above the step budget


def test_prompt_step_sizer_env(monkeypatch):
    from fastdeploy_core.engine.engine_core import PROMPT_STEP_TARGET_ENV, PromptStepSizer
    from fastdeploy_core.errors import ConfigError

    monkeypatch.setenv(PROMPT_STEP_TARGET_ENV, "0")
    assert PromptStepSizer.from_env(64, 2048) is None
    monkeypatch.setenv(PROMPT_STEP_TARGET_ENV, "250")
    assert PromptStepSizer.from_env(64, 2048).target_s == 0.25
    monkeypatch.setenv(PROMPT_STEP_TARGET_ENV, "fast")
    with pytest.raises(ConfigError, match=PROMPT_STEP_TARGET_ENV):
        PromptStepSizer.from_env(64, 2048)
    monkeypatch.delenv(PROMPT_STEP_TARGET_ENV)
    assert PromptStepSizer.from_env(64, 32).cap == 32  # the budget bounds the smallest step too


def test_prompt_block_share_keeps_blocks_for_running_requests():
    """kv_cache_ratio: a second prompt waits while admitting it would put the blocks in use past
    the share; the first (lone) request is admitted whatever its size, and nothing is lost."""
    for share, second_admitted_at_once in ((1.0, True), (0.5, False)):
        bm = BlockManager(10, 4)  # 40 token slots
        sched = Scheduler(bm, 4, 64, prompt_block_share=share)
        first = make_request("first", list(range(1, 17)), 2)  # 4 blocks + 1 for output
        second = make_request("second", list(range(30, 42)), 2)  # 3 blocks
        sched.add_request(first)
        sched.add_request(second)
        out = sched.schedule()
        admitted = [r.request_id for r, _ in out.scheduled]
        assert admitted == (["first", "second"] if second_admitted_at_once else ["first"])
        sched.update(out, [5 if out.samples(i) else None for i in range(len(out.scheduled))])
        for _ in range(10):  # the second starts once the first is done with its blocks
            if not sched.has_unfinished_requests():
                break
            out = sched.schedule()
            sched.update(out, [5 if out.samples(i) else None for i in range(len(out.scheduled))])
        assert not sched.has_unfinished_requests()
        assert first.num_output_tokens == second.num_output_tokens == 2
        assert bm.num_free_blocks == 10


def test_chunk_cost_and_tokens_within_count_attended_keys():
    from fastdeploy_core.engine.scheduler import chunk_cost, tokens_within

    assert chunk_cost(0, 4, 0.0) == 4
    assert chunk_cost(10, 4, 0.5) == 4 + 0.5 * (4 * 10 + 10)  # keys 11, 12, 13, 14 for the four tokens
    assert tokens_within(0, 10**6, 1000, 1e-3) == 731  # 731 + 1e-3 * 731 * 732 / 2 = 998.6; 732 tokens: 1000.6
    assert tokens_within(0, 10**6, 1000, 0.0) == 1000
    assert tokens_within(0, 300, 1000, 1e-3) == 300  # everything wanted fits
    assert tokens_within(0, 10**6, float("inf"), 1e-3) == 10**6
    assert tokens_within(7000, 10**6, 1000, 1e-3) == 124  # each token attends to ~7,100 keys: ~8.1 units
    for computed in (0, 5, 999, 12345):
        for cost in (0.5, 1, 17.25, 999):
            n = tokens_within(computed, 10**6, cost, 3e-4)
            assert chunk_cost(computed, n, 3e-4) <= cost < chunk_cost(computed, n + 1, 3e-4)


def test_prompt_cap_in_cost_units_shrinks_chunks_as_the_context_grows():
    """A long prompt beside a running decode: with the attention weight the prompt part of each
    step stays within the cap's cost (so the decode's step time stays bounded) and the chunks
    shrink as the keys each token attends to grow; without it every chunk is cap tokens."""
    from fastdeploy_core.engine.scheduler import chunk_cost

    def chunks(weight: float) -> list[tuple[int, int]]:
        sched = Scheduler(BlockManager(1024, 16), 8, 4096)
        sched.add_request(make_request("d", [1, 2, 3], 100))
        _step(sched)  # d's prompt: d decodes from now on
        sched.prompt_token_cap = 1000
        sched.attention_key_weight = weight
        sched.add_request(make_request("p", [(7 * j) % 50 + 3 for j in range(6000)], 2))
        seen = []
        while True:
            out = sched.schedule()
            assert [r.request_id for r, _ in out.scheduled] == ["d", "p"]
            p, n = out.scheduled[1]
            seen.append((p.num_computed_tokens, n))
            last = out.samples(1)
            sched.update(out, [5 if out.samples(i) else None for i in range(2)])
            if last:
                return seen

    flat = chunks(0.0)
    assert [n for _, n in flat] == [1000] * 6
    weighted = chunks(1e-3)
    assert sum(n for _, n in weighted) == 6000
    sizes = [n for _, n in weighted]
    assert sizes[0] == 731 and sizes == sorted(sizes, reverse=True) and sizes[-2] < 200
    for computed, n in weighted[:-1]:  # each chunk the largest that fits the cap
        assert chunk_cost(computed, n, 1e-3) <= 1000 < chunk_cost(computed, n + 1, 1e-3)


def test_first_prompt_of_a_step_gets_a_token_however_deep_its_context():
    sched = Scheduler(BlockManager(1024, 16), 8, 4096)
    sched.add_request(make_request("d", [1, 2, 3], 100))
    _step(sched)
    sched.prompt_token_cap = 1
    sched.attention_key_weight = 1.0  # one token at any context costs more than the cap
    sched.add_request(make_request("p", [4] * 40, 2))
    assert _step(sched) == [("d", 1), ("p", 1)]
    assert _step(sched) == [("d", 1), ("p", 1)]


def test_step_cost_counts_decodes_at_their_context():
    sched = Scheduler(BlockManager(64, 4), 8, 64)
    sched.add_request(make_request("a", [1, 2, 3, 4], 10))
    out = sched.schedule()
    assert out.cost(0.0) == 4 and out.cost(0.5) == 4 + 0.5 * 10
    sched.update(out, [5])
    out = sched.schedule()  # a decodes: 1 token over 5 keys
    assert out.cost(0.5) == 1 + 0.5 * 5


def test_attention_key_weight_from_the_model_shape():
    from fastdeploy_core.engine.engine_core import attention_key_weight

    smollm2 = {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
    }
    # 4 * 9 * 64 * 30 FLOPs per (query, key) over 2 * (30 * (576 * 64 * 24 + 3 * 576 * 1536) + 576 * 49152)
    assert attention_key_weight(smollm2) == pytest.approx(69120 / 268_959_744)
    assert attention_key_weight({"hidden_size": 576}) == 0.0
