"""The batch scheduler: which requests run in the next step, and with how many tokens.

Policy only; it never touches a tensor. Each step has one token budget
(``max_num_batched_tokens``) and at most ``max_num_seqs`` running requests:

1. running requests first, in policy order: one token each while decoding, or the next chunk
   of their prompt; when the block manager runs out of blocks the newest running request (the
   last in policy order) is preempted: its blocks are freed and it goes back to the waiting
   queue to be recomputed later (its prefix-cached blocks often survive);
2. then waiting requests, in policy order, while budget, sequence slots and blocks last; a
   prompt longer than the remaining budget is chunked (when ``enable_chunked_prefill``).

With ``mix_prefill_decode=False`` a step holds either prompt work (chunks of running prompts,
then waiting requests) or decodes (one token for each running request past its prompt), never
both: attention backends that pad every sequence of a step to its longest query run pay for a
64-token prompt chunk beside 15 decodes as if all 16 sequences had 64 queries (3-5x the cost of
the two steps run apart on the cpu device). When both kinds of work are pending the two kinds
of step alternate, so decodes wait for at most one prompt step and a new prompt for at most one
decode step. When the chosen kind has nothing it can run this step, the other kind runs.

``prompt_token_cap`` (None by default; the engine core sets it from measured step times) bounds
the prompt tokens of one step while other requests share the engine, so a burst of prompts is
computed a few at a time: the first ones start decoding (and answering) while the rest wait,
instead of all waiting for one long step. The first prompt of a step that cannot be chunked
(``enable_chunked_prefill=False``) is taken whole.

The cap counts cost, not tokens, once ``attention_key_weight`` is set (the engine core sets it
from the model's shape): a chunk of ``n`` prompt tokens after ``c`` computed ones costs
``n + w * (n * c + n * (n + 1) / 2)`` (:func:`chunk_cost`), its tokens' own work plus the keys
each one attends to, weighed against a token's other work. Deep into a long prompt every token
attends to thousands of keys, so the chunks beside running decodes shrink as the context grows
and the decodes' step time stays near the cap's target instead of growing with the prompt.

Policies: ``fcfs`` (arrival order) and ``priority`` (lower ``priority`` value first, then
arrival). :meth:`Scheduler.update` takes the sampled tokens back (``sampled_token_ids`` of
the runner's :class:`~fastdeploy_core.executor.step_io.RunnerOutput`; the engine core keeps the
logprobs) and finishes requests on eos / ``stop_token_ids`` (after ``min_tokens``),
``max_tokens`` or ``max_model_len``.

Speculative decoding: after :meth:`Scheduler.schedule`, the engine core asks
:meth:`Scheduler.draft_candidates` which decode rows may speculate, has its proposer guess their
next tokens, and :meth:`Scheduler.add_drafts` grows those rows to ``1 + k`` query tokens within
the token budget and the free blocks (never preempting for a guess). :meth:`Scheduler.update`
then counts only the accepted drafts as computed.

:meth:`Scheduler.schedule` returns a :class:`ScheduledBatch` of the engine's own requests;
:meth:`ScheduledBatch.runner_input` turns it into the plain rows the runner reads
(:class:`~fastdeploy_core.executor.step_io.SchedulerOutput`).
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field

from fastdeploy_core.engine.block_manager import BlockManager
from fastdeploy_core.engine.request import Request, RequestStatus
from fastdeploy_core.executor.step_io import ScheduledRequest, SchedulerOutput

POLICIES = ("fcfs", "priority")


def speculates(req: Request) -> bool:
    """Whether ``req``'s tokens may come from verified drafts: greedy or sampled, with
    penalties, bad words, ``min_tokens`` and logprobs too (the runner scores each draft position
    as if the drafts before it had been emitted, and a sampled draw depends only on the
    request's seed and the position), but not under a guided-decoding grammar (its mask is
    known for the next token only). Such requests decode one token per step beside
    speculating ones."""
    return req.guided is None


def chunk_cost(computed: int, n: int, attention_key_weight: float) -> float:
    """The cost of computing ``n`` tokens of a sequence after ``computed`` ones, in prompt-token
    units: each token's own work (1) plus ``attention_key_weight`` per key it attends to
    (itself and every token before it)."""
    return n + attention_key_weight * (n * computed + n * (n + 1) / 2)


def tokens_within(computed: int, wanted: int, cost: float, attention_key_weight: float) -> int:
    """The most tokens (at most ``wanted``) after ``computed`` ones whose :func:`chunk_cost` fits ``cost``."""
    if cost <= 0 or wanted <= 0:
        return 0
    w = attention_key_weight
    if chunk_cost(computed, wanted, w) <= cost:  # also an unbounded cost
        return wanted
    if w <= 0:
        return int(cost)
    # w/2 n^2 + (1 + w (computed + 1/2)) n <= cost, solved for n, then corrected for rounding.
    b = 1 + w * (computed + 0.5)
    n = min(wanted, int((-b + (b * b + 2 * w * cost) ** 0.5) / w))
    while n < wanted and chunk_cost(computed, n + 1, w) <= cost:
        n += 1
    while n > 0 and chunk_cost(computed, n, w) > cost:
        n -= 1
    return n


@dataclass
class ScheduledBatch:
    """One step as the scheduler decided it: ``scheduled[i] = (request, num_new_tokens)`` in
    batch order, and the requests preempted to make room."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def cost(self, attention_key_weight: float) -> float:
        """The step's work in :func:`chunk_cost` units, decodes included (read before
        :meth:`Scheduler.update` advances the requests)."""
        return sum(chunk_cost(req.num_computed_tokens, n, attention_key_weight) for req, n in self.scheduled)

    def samples(self, index: int) -> bool:
        """Whether request ``index`` reaches its last token this step (so a token is sampled)."""
        req, n = self.scheduled[index]
        return req.num_computed_tokens + n - len(req.draft_token_ids) == req.num_tokens

    def runner_input(self, token_bitmasks: list | None = None) -> SchedulerOutput:
        """The step as the runner reads it: one plain row per scheduled request.

        ``token_bitmasks[i]``: the allowed-token bitmask of row ``i`` (guided decoding), or None."""
        rows = []
        for i, (req, n) in enumerate(self.scheduled):
            done = req.prompt_logprobs
            rows.append(
                ScheduledRequest(
                    request_id=req.request_id,
                    all_token_ids=req.all_token_ids,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_computed_tokens=req.num_computed_tokens,
                    num_new_tokens=n,
                    block_table=req.block_table,
                    sampling_params=req.sampling_params,
                    eos_token_ids=req.eos_token_ids,
                    sample_seed=req.sample_seed,
                    samples=self.samples(i),
                    prompt_logprobs_from=len(done) - 1 if done is not None else 0,
                    draft_token_ids=req.draft_token_ids,
                    token_bitmask=token_bitmasks[i] if token_bitmasks is not None else None,
                )
            )
        return SchedulerOutput(rows)


class Scheduler:
    """Continuous batching over a :class:`BlockManager`."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        mix_prefill_decode: bool = True,
        prompt_block_share: float = 1.0,
    ):
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.mix_prefill_decode = mix_prefill_decode
        #: ``kv_cache_ratio``: while requests run, a waiting one is admitted only if the blocks in use
        #: afterwards stay within this share of the pool; the rest is kept for the running requests'
        #: output, so fewer of them are preempted when a burst of prompts arrives (FastDeploy's
        #: prefill/decode block split). 1.0: prompts may take every free block.
        self.prompt_block_share = prompt_block_share
        self.prompt_token_cap: int | None = None
        #: The cost of one query token attending to one key, in units of a prompt token's other
        #: work (see :func:`chunk_cost`); 0 counts the cap in tokens.
        self.attention_key_weight: float = 0.0
        self.last_step_kind: str | None = None  # "prefill" / "decode" / "mixed" (the last non-empty step)
        self.waiting: list[Request] = []  # sorted by policy key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        #: Requests holding blocks for a prompt another instance computes (a decode instance's;
        #: :meth:`reserve`), in neither queue until :meth:`admit_prefilled`.
        self.reserved: dict[str, Request] = {}
        #: Called with a request just before its blocks are freed when it finishes (a prefill
        #: instance reads the finished prompt's blocks; they keep their contents until reused).
        self.on_finish = None
        self._counter = itertools.count()
        self.num_preemptions = 0
        #: Speculative decoding: draft tokens scored, and those the target accepted.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_speculative_rows = 0  # row-steps that carried drafts (each emits accepted + 1)

    # ---- queue -----------------------------------------------------------------------------
    def _key(self, req: Request) -> tuple:
        if self.policy == "priority":
            return (req.priority, req.sequence_number)
        return (req.sequence_number,)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the scheduler")
        req.sequence_number = next(self._counter)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        bisect.insort(self.waiting, req, key=self._key)

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: a reserved request waits for another instance, not for a step."""
        return len(self.requests) > len(self.reserved)

    # ---- prompts computed elsewhere (prefill/decode disaggregation) -------------------------
    def reserve(self, req: Request) -> bool:
        """Hold blocks for ``req``'s whole prompt outside the queues; False (nothing held) when
        the free blocks do not suffice. Its block table then names where the prompt's KV goes."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the scheduler")
        if not self.block_manager.allocate(req, req.num_prompt_tokens):
            return False
        req.sequence_number = next(self._counter)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.reserved[req.request_id] = req
        return True

    def admit_prefilled(self, req: Request, token: int) -> bool:
        """A reserved request whose prompt KV is now in its blocks, with the first token sampled
        elsewhere: it joins the running requests (or finishes on that token). True if it finished."""
        self.reserved.pop(req.request_id)
        now = time.time()
        req.num_computed_tokens = req.num_prompt_tokens
        req.scheduled_time = req.scheduled_time or now
        req.append_output_token(int(token))
        req.first_token_time = now
        self.block_manager.cache_full_blocks(req)
        status = self._stop_status(req, int(token))
        if status is not None:
            self._finish(req, status, now)
            return True
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return False

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick this step's requests and token counts, allocating their KV blocks."""
        self.running.sort(key=self._key)
        if self.mix_prefill_decode:
            kinds: tuple[str, ...] = ("mixed",)
        else:
            decoding = any(r.num_uncomputed_tokens == 1 for r in self.running)
            prompting = bool(self.waiting) or any(r.num_uncomputed_tokens > 1 for r in self.running)
            if decoding and prompting:
                kinds = ("decode", "prefill") if self.last_step_kind == "prefill" else ("prefill", "decode")
            else:
                kinds = ("decode",) if decoding else ("prefill",)
        out = ScheduledBatch()
        for kind in kinds:
            self._schedule(kind, out)
            if not out.is_empty:
                self.last_step_kind = kind
                break
        return out

    def _schedule(self, kind: str, out: ScheduledBatch) -> None:
        """Fill ``out`` with one step of ``kind``: "mixed" (everything), "decode" (running
        requests past their prompt) or "prefill" (prompt chunks of running requests, then
        waiting requests)."""
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        weight = self.attention_key_weight
        prompt_budget = float("inf")  # in chunk_cost units
        if self.prompt_token_cap is not None and len(self.running) + len(self.waiting) > 1:
            prompt_budget = max(1, self.prompt_token_cap)
        first_prompt = True

        def prompt_tokens(computed: int, wanted: int) -> int:
            """How many of ``wanted`` prompt tokens after ``computed`` fit this step (0: none; a
            whole unchunkable prompt beyond the cap only as the step's first prompt, and at
            least one token of the step's first prompt however deep its context)."""
            n = min(wanted, budget)
            if first_prompt and not self.enable_chunked_prefill:
                return n
            fits = tokens_within(computed, n, prompt_budget, weight)
            return max(fits, 1) if first_prompt and n > 0 else fits

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            decoding = req.num_uncomputed_tokens == 1
            if kind != "mixed" and decoding != (kind == "decode"):
                i += 1
                continue
            num_new = 1 if decoding else prompt_tokens(req.num_computed_tokens, req.num_uncomputed_tokens)
            if num_new == 0 or (num_new < req.num_uncomputed_tokens and not self.enable_chunked_prefill):
                i += 1
                continue
            preempted_self = False
            while not bm.append(req, req.num_computed_tokens + num_new):
                victim = self.running.pop()  # newest in policy order; never one scheduled already
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                continue
            out.scheduled.append((req, num_new))
            budget -= num_new
            if not decoding:
                prompt_budget -= chunk_cost(req.num_computed_tokens, num_new, weight)
                first_prompt = False
            i += 1

        if not out.preempted and kind != "decode":
            while self.waiting and budget > 0 and prompt_budget > 0 and len(self.running) < self.max_num_seqs:
                # A request whose grammar is still compiling waits; those behind it may start.
                req = next((r for r in self.waiting if r.is_ready), None)
                if req is None:
                    break
                cached = bm.find_cached_blocks(req)
                num_computed = len(cached) * bm.block_size
                wanted = req.num_tokens - num_computed
                num_new = prompt_tokens(num_computed, wanted)
                if num_new == 0 or (num_new < wanted and not self.enable_chunked_prefill):
                    break
                if self.running and not self._within_prompt_share(req, num_computed + num_new, cached):
                    break
                if not bm.allocate(req, num_computed + num_new, cached):
                    break
                self.waiting.remove(req)
                if req.num_preemptions == 0:
                    req.num_cached_tokens = num_computed
                req.num_computed_tokens = num_computed
                req.status = RequestStatus.RUNNING
                if req.scheduled_time is None:
                    req.scheduled_time = time.time()
                self.running.append(req)
                out.scheduled.append((req, num_new))
                budget -= num_new
                prompt_budget -= chunk_cost(num_computed, num_new, weight)
                first_prompt = False

    # ---- speculative decoding --------------------------------------------------------------
    def draft_candidates(self, out: ScheduledBatch, max_drafts: int) -> list[tuple[int, int]]:
        """``(batch index, most drafts)`` for the rows of ``out`` that may speculate this step.

        A row speculates when it decodes one token, :func:`speculates` allows its request (then
        each position's target token is what one-token decoding would give, and accepting a
        draft cannot change the output), and its length limit leaves room: accepting ``d``
        drafts emits ``d + 1`` tokens."""
        found = []
        for index, (req, n) in enumerate(out.scheduled):
            if n != 1 or req.num_uncomputed_tokens != 1 or not speculates(req):
                continue
            room = min(max_drafts, req.max_total_tokens - req.num_tokens - 1)
            if room > 0:
                found.append((index, room))
        return found

    def add_drafts(self, out: ScheduledBatch, drafts: dict[int, list[int]]) -> int:
        """Append ``drafts[index]`` to those decode rows of ``out``, within the step's token
        budget and the free KV blocks (a draft never preempts anyone: what does not fit is cut).
        Returns the number of draft tokens scheduled."""
        budget = self.max_num_batched_tokens - out.num_scheduled_tokens
        bm = self.block_manager
        added = 0
        for index, tokens in drafts.items():
            req, n = out.scheduled[index]
            tokens = list(tokens[: max(0, budget)])
            while tokens and not bm.append(req, req.num_computed_tokens + n + len(tokens)):
                tokens.pop()
            if not tokens:
                continue
            req.draft_token_ids = tokens
            out.scheduled[index] = (req, n + len(tokens))
            budget -= len(tokens)
            added += len(tokens)
        return added

    def _within_prompt_share(self, req: Request, num_tokens: int, cached: list[int]) -> bool:
        """Whether admitting ``req`` with ``num_tokens`` keeps the blocks in use within
        :attr:`prompt_block_share` of the pool (a lone request is always admitted)."""
        if self.prompt_block_share >= 1.0:
            return True
        bm = self.block_manager
        revived = sum(1 for b in cached if bm.blocks[b].ref_count == 0)
        in_use_after = bm.num_blocks - bm.num_free_blocks + revived + bm.blocks_needed(num_tokens) - len(cached)
        return in_use_after <= self.prompt_block_share * bm.num_blocks

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, req, key=self._key)

    def update(
        self, out: ScheduledBatch, sampled: list[int | None], spec: list[list[int] | None] | None = None
    ) -> list[Request]:
        """Advance counts by the step's tokens; ``sampled[i]`` is the new token of request ``i``
        (``RunnerOutput.sampled_token_ids``: None while a prompt chunk is not the last);
        ``spec[i]``, for a row that carried drafts, the tokens it emits
        (``RunnerOutput.spec_token_ids``). Returns the requests that finished."""
        finished: list[Request] = []
        now = time.time()
        bm = self.block_manager
        for i, ((req, num_new), token) in enumerate(zip(out.scheduled, sampled)):
            if req.draft_token_ids:
                if self._update_speculative(req, spec[i] if spec else None, now):
                    finished.append(req)
                continue
            if req.is_finished:  # aborted since it was scheduled
                continue
            req.num_computed_tokens += num_new
            if token is None:
                bm.cache_full_blocks(req)
                continue
            req.append_output_token(int(token))
            if req.first_token_time is None:
                req.first_token_time = now
            bm.cache_full_blocks(req)
            status = self._stop_status(req, int(token))
            if status is not None:
                self._finish(req, status, now)
                finished.append(req)
        return finished

    def _update_speculative(self, req: Request, tokens: list[int] | None, now: float) -> bool:
        """Apply a speculating row's emitted tokens (accepted drafts + the target's next one).

        Only the accepted tokens' K/V count as computed: the row computed its last token and
        ``k`` drafts, and ``len(tokens) - 1`` drafts were accepted, so ``num_computed_tokens``
        grows by ``len(tokens)``. The rejected drafts' cache slots are beyond that count: the
        next step writes over them, and blocks taken for them stay in the table for the tokens
        that follow (never registered in the prefix cache, which takes computed blocks only).
        Tokens after one that finishes the request are dropped. Returns whether it finished."""
        drafts = req.draft_token_ids
        req.draft_token_ids = []
        if req.is_finished or not tokens:  # aborted since it was scheduled
            return False
        req.num_draft_tokens += len(drafts)
        req.num_accepted_tokens += len(tokens) - 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += len(tokens) - 1
        self.num_speculative_rows += 1
        req.num_computed_tokens += len(tokens)
        if req.first_token_time is None:
            req.first_token_time = now
        for token in tokens:
            req.append_output_token(int(token))
            status = self._stop_status(req, int(token))
            if status is not None:
                self.block_manager.cache_full_blocks(req)
                self._finish(req, status, now)
                return True
        self.block_manager.cache_full_blocks(req)
        return False

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        if req.num_output_tokens >= req.sampling_params.min_tokens and token in req.eos_token_ids:
            stop_ids = req.sampling_params.stop_token_ids or ()
            req.stop_reason = token if token in stop_ids else None
            return RequestStatus.FINISHED_STOPPED
        if req.num_tokens >= req.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus, now: float | None = None) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.reserved.pop(req.request_id, None)
        if self.on_finish is not None:
            self.on_finish(req, status)
        self.block_manager.free(req)
        req.status = status
        req.finish_time = now or time.time()
        self.requests.pop(req.request_id, None)

    def finish_requests(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        """End requests from outside (abort, stop string); their blocks are free on return."""
        done = []
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None:
                continue
            self._finish(req, status)
            done.append(req)
        return done
