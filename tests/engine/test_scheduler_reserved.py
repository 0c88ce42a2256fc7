"""The scheduler's side of prefill/decode disaggregation: blocks held for a prompt computed elsewhere."""

from __future__ import annotations

from fastdeploy_core.engine.block_manager import BlockManager
from fastdeploy_core.engine.request import Request, RequestStatus
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.engine.scheduler import Scheduler


def _request(rid: str, n: int, max_tokens: int = 4, eos: tuple[int, ...] = (2,)) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(10, 10 + n)), sampling_params=SamplingParams(),
                   eos_token_ids=eos, max_total_tokens=n + max_tokens)


def _scheduler(blocks: int = 8) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(blocks, 4)
    return Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64), bm


def test_a_reserved_request_holds_its_prompt_blocks_and_is_not_step_work():
    sched, bm = _scheduler()
    req = _request("a", 10)
    assert sched.reserve(req)
    assert len(req.block_table) == 3 and bm.num_free_blocks == 5
    assert not sched.has_unfinished_requests() and sched.schedule().is_empty
    assert not sched.reserve(_request("b", 24))  # 6 blocks: not there, nothing held
    assert bm.num_free_blocks == 5 and "b" not in sched.requests
    bm.check_invariants([req])


def test_admitted_with_its_first_token_it_decodes_in_the_batch():
    sched, bm = _scheduler()
    req = _request("a", 10)
    sched.reserve(req)
    assert not sched.admit_prefilled(req, 7)
    assert req.output_token_ids == [7] and req.num_computed_tokens == 10 and req.status == RequestStatus.RUNNING
    assert sched.has_unfinished_requests()
    batch = sched.schedule()
    assert [(r.request_id, n) for r, n in batch.scheduled] == [("a", 1)]
    assert bm.num_free_blocks == 5  # token 11 still fits the third block
    sched.update(batch, [2])  # eos
    assert req.status == RequestStatus.FINISHED_STOPPED and bm.num_free_blocks == 8


def test_a_first_token_that_ends_it_frees_at_once_and_the_hook_sees_the_table():
    sched, bm = _scheduler()
    seen = []
    sched.on_finish = lambda r, status: seen.append((r.request_id, list(r.block_table), status))
    req = _request("a", 6)
    sched.reserve(req)
    table = list(req.block_table)
    assert sched.admit_prefilled(req, 2)
    assert seen == [("a", table, RequestStatus.FINISHED_STOPPED)]
    assert bm.num_free_blocks == 8 and not sched.requests and not sched.reserved


def test_an_abort_frees_a_reserved_request():
    sched, bm = _scheduler()
    req = _request("a", 10)
    sched.reserve(req)
    assert sched.finish_requests(["a"]) == [req]
    assert bm.num_free_blocks == 8 and not sched.reserved and not sched.requests
