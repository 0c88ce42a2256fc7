"""What one step asks of the model runner, and what the runner gives back: the only data that
crosses between the engine and the executor.

The engine's scheduler decides (which requests run, with how many tokens, in which KV blocks);
it turns that decision into a :class:`SchedulerOutput` of plain rows. The runner executes it and
returns a :class:`RunnerOutput` (sampled tokens, logprobs, prompt logprobs, row by row); the
engine applies that to its own request state. The runner never sees the engine's ``Request``
objects and never writes into engine state.

Why this module lives in ``executor/``: it is the runner's interface, like the signature of
``ModelRunner.execute_model``, so it belongs to the callee. The engine (the higher layer) already
imports the executor to build its runner; with the contract here every import points one way,
engine -> executor, and the executor imports nothing from the engine. It imports only the
standard library, so the pure-Python scheduler can import it without loading paddle.

Rows share the engine's token and block lists instead of copying them: copying every sequence's
tokens each step would cost time in proportion to the whole context, where the runner reads one
token per decoding sequence. The runner reads them during ``execute_model`` only, never writes
them and keeps no reference after it returns. A sampled row's randomness is a function of its
request's ``sample_seed`` and the output position (:func:`~fastdeploy_core.executor.sampler.position_uniform`),
not a stream the runner advances: a seeded request gets the same tokens whatever batch it runs
in and however many of its tokens a speculative step verifies at once.

The runner keeps no per-request state between steps, so a step carries no preempted or finished
request ids: a preempted request is simply scheduled again from ``num_computed_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np


class SamplingSpec(Protocol):
    """The sampling settings a row's sampler reads (the engine's ``SamplingParams`` has them)."""

    logprobs: int | None
    prompt_logprobs: int | None
    presence_penalty: float
    frequency_penalty: float
    bad_words_token_ids: list[list[int]] | None
    min_tokens: int

    @property
    def is_greedy(self) -> bool: ...

    def resolved(self, name: str) -> Any:
        """``temperature``, ``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty`` with
        defaults applied."""
        ...


@dataclass(slots=True)
class ScheduledRequest:
    """One row of a step: a request and the tokens of it the runner computes this step."""

    request_id: str
    #: Prompt then generated tokens so far (the engine's list, read-only for the runner).
    all_token_ids: list[int]
    num_prompt_tokens: int
    #: Tokens whose K/V are in the cache already: this step computes positions
    #: ``num_computed_tokens .. num_computed_tokens + num_new_tokens - 1``.
    num_computed_tokens: int
    num_new_tokens: int
    #: KV block ids of the sequence, in position order (the engine's list, read-only).
    block_table: list[int]
    sampling_params: SamplingSpec
    #: Tokens masked before ``min_tokens`` (eos and stop token ids).
    eos_token_ids: tuple[int, ...]
    #: The request's sampling seed (its ``seed``, or one the engine drew); None draws from
    #: numpy's global stream (rows built by hand).
    sample_seed: int | None
    #: Whether the row reaches the sequence's last token this step, so a token is sampled.
    samples: bool
    #: First prompt position whose prompt logprobs the engine does not hold yet (the row for
    #: position ``p`` predicts prompt token ``p + 1``); after a preemption the prompt is computed
    #: again but its logprobs are not returned twice.
    prompt_logprobs_from: int = 0
    #: Speculative draft tokens scored after the row's last token (``num_new_tokens`` counts them):
    #: the runner returns the target's tokens for the accepted prefix plus one
    #: (:attr:`RunnerOutput.spec_token_ids`). Empty for rows that do not speculate.
    draft_token_ids: list[int] = field(default_factory=list)
    #: Guided decoding: the tokens this row may sample, as an int32 bitmask (bit ``t % 32`` of
    #: word ``t // 32`` set when token ``t`` is allowed); None for an unconstrained row.
    token_bitmask: np.ndarray | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def query_token_ids(self) -> list[int]:
        """The tokens this row feeds the model: the uncomputed ones, then any draft tokens."""
        start = self.num_computed_tokens
        if not self.draft_token_ids:
            return self.all_token_ids[start : start + self.num_new_tokens]
        return self.all_token_ids[start:] + self.draft_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy; penalties and bad words read them)."""
        return self.all_token_ids[self.num_prompt_tokens :]


@dataclass(slots=True)
class SchedulerOutput:
    """What the scheduler decided for one step, in batch order."""

    requests: list[ScheduledRequest] = field(default_factory=list)
    #: Return the target's last hidden states of every computed row
    #: (:attr:`RunnerOutput.hidden_states`): a proposer drafting from them (``mtp``) asks.
    return_hidden_states: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests)


@dataclass(slots=True)
class RunnerOutput:
    """What the runner produced for one step; index ``i`` is ``SchedulerOutput.requests[i]``."""

    #: The sampled token, or None for a row that does not sample (a prompt chunk before the last).
    sampled_token_ids: list[int | None]
    #: ``{sampled token: lp, top tokens by rank: lp}`` for sampled rows whose request asked.
    logprobs: list[dict[int, float] | None]
    #: For rows whose request asked for prompt logprobs: the entries for the prompt positions
    #: computed this step from ``prompt_logprobs_from`` on, in position order (possibly empty);
    #: None for the other rows.
    prompt_logprobs: list[list[dict[int, float]] | None]
    #: For rows with draft tokens: the target's tokens for the longest agreeing prefix of the
    #: drafts plus the one after it (1 to k + 1 tokens; ``sampled_token_ids`` holds the first);
    #: None for the other rows.
    spec_token_ids: list[list[int] | None] = field(default_factory=list)
    #: For rows with draft tokens whose request asked for logprobs: one entry per token of
    #: ``spec_token_ids`` (``logprobs`` holds the first); None for the other rows.
    spec_logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)
    #: When the step asked (:attr:`SchedulerOutput.return_hidden_states`): per row, the model's
    #: output hidden states (after the final norm, before the LM head) of the row's query tokens,
    #: a ``[num_new_tokens, H]`` device tensor for positions ``num_computed_tokens ...`` (the
    #: rows after a rejected draft are computed from that draft: the reader drops them). Empty
    #: otherwise.
    hidden_states: list[Any] = field(default_factory=list)
