"""Engine-side request state: counts, not flags.

A :class:`Request` is one sequence inside the engine core (an ``n > 1`` request becomes ``n``
of them). Its phase is derived from counts: the scheduler only asks how many tokens are not in
the KV cache yet (:attr:`Request.num_uncomputed_tokens`): many while prefilling (or recomputing
after preemption), one while decoding. A speculating decode step also computes the step's
``draft_token_ids``; only the ones the target accepted count in ``num_computed_tokens``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from fastdeploy_core.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is; every ``FINISHED_*`` status is terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass(slots=True, eq=False)
class Request:
    """One sequence: its tokens, its KV blocks and its timing."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    #: The user-visible request id and the choice index (for ``n > 1``).
    parent_id: str = ""
    index: int = 0
    #: Token ids that end this request (eos of the model, unless ignore_eos, plus stop_token_ids).
    eos_token_ids: tuple[int, ...] = ()
    #: Generation stops when the sequence reaches this many tokens (min of max_tokens, max_model_len).
    max_total_tokens: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    #: Tokens whose K/V are in the cache (prefix hits included).
    num_computed_tokens: int = 0
    #: Tokens served from the prefix cache at the first admission.
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    #: Chained hashes of the full blocks of ``all_token_ids`` computed so far.
    block_hashes: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    #: Arrival order inside the engine (tie-breaker for the policies).
    sequence_number: int = 0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    #: Sampling seed: the token at output position ``n`` is drawn with
    #: ``position_uniform(sample_seed, n)`` (the request's ``seed``, or one the engine drew).
    sample_seed: int | None = None
    #: Prompt logprobs gathered chunk by chunk (index i: logprobs of prompt token i; 0 is None).
    prompt_logprobs: list[Any] | None = None
    prompt_logprobs_sent: bool = False
    #: This step's speculative draft tokens (scheduled after the last token; cleared by the update).
    draft_token_ids: list[int] = field(default_factory=list)
    #: Draft tokens proposed for / accepted by this request so far (speculative decoding).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: The request's grammar state (:class:`fastdeploy_core.guided.manager.RequestGrammar`) when
    #: its output is constrained; it is scheduled only once the grammar is compiled.
    guided: Any = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if not self.parent_id:
            self.parent_id = self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens to feed the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_ready(self) -> bool:
        """Whether the request can be scheduled (its grammar, if any, is compiled)."""
        return self.guided is None or self.guided.ready

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
