"""The proposer contract: what a speculative-decoding method implements.

A proposer guesses, for each decoding request of a step, up to ``max_tokens`` tokens that the
target model is likely to produce next. It never decides what is emitted: the engine appends
the guesses to the request's row of the same batched step (a row of ``1 + k`` query tokens),
the runner computes the target's own token at each of the ``k + 1`` positions, and the longest
prefix of the guesses the target agrees with is kept, plus the target's token after it. So a
proposer changes how many tokens a step yields, never which tokens.

Proposers are registered through the ``register_proposers`` hook (the core's own ``ngram`` and
``draft_model`` in ``fastdeploy_core/builtin/plugin.py``) and chosen by ``--speculative-config``'s ``method``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastdeploy_core.config import EngineArgs, SpeculativeConfig
from fastdeploy_core.errors import ConfigError


@dataclass(slots=True)
class DraftRequest:
    """One decoding request asking for draft tokens this step."""

    request_id: str
    #: Prompt then generated tokens so far (the engine's list: read it, never keep or change it).
    token_ids: list[int]
    num_prompt_tokens: int
    #: Propose at most this many (the speculative budget, clipped to the request's length limit).
    max_tokens: int
    #: The request's KV block ids in the target's cache, in position order (the engine's list:
    #: read it, never keep or change it); blocks exist for the positions up to the request's
    #: last token. A proposer whose cache shares the target's block ids (``mtp``) writes there.
    block_table: list[int] = field(default_factory=list)


@dataclass(slots=True)
class ProposerContext:
    """What a proposer may know about the engine it serves."""

    engine_args: EngineArgs
    vocab_size: int
    max_model_len: int
    #: The target's KV cache blocks (a proposer with a cache of its own sizes it by this); None
    #: when no target runner exists (a proposer built alone, in tests).
    num_blocks: int | None = None
    #: The engine's plugin manager (a proposer that loads a model builds it through the same
    #: registries); None: the process's default one.
    plugin_manager: Any = None
    #: The target's model runner (a proposer drafting with the target's own layers, ``mtp``,
    #: runs them through it); None when no target runner exists.
    runner: Any = None


#: ``--speculative-config`` keys the engine reads for every method.
ENGINE_KEYS = frozenset({"method", "num_speculative_tokens", "disable_by_batch_size"})


class Proposer(ABC):
    """Base of speculative-decoding proposers (see the module docstring).

    Subclasses set :attr:`reads` to the ``--speculative-config`` keys they use beyond
    ``method`` and ``num_speculative_tokens``; a key given for a method that does not read it
    is refused (an option that does nothing would mislead its user).
    """

    #: The ``--speculative-config`` keys (besides the engine's: ENGINE_KEYS) this method reads.
    reads: ClassVar[frozenset[str]] = frozenset()
    #: Whether the proposer drafts from the target's hidden states: the engine then asks the
    #: runner for them each step and hands them over through :meth:`observe`.
    wants_hidden_states: ClassVar[bool] = False
    #: Whether it drafts with the model's MTP layers over the runner's MTP cache: the engine
    #: then has the runner budget and allocate that cache with the target's KV cache.
    uses_mtp_cache: ClassVar[bool] = False

    def __init__(self, config: SpeculativeConfig, context: ProposerContext):
        self.config = config
        self.context = context

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        """Refuse keys this method would not read (ConfigError naming them)."""
        ignored = sorted(
            k for k in config.model_fields_set - ENGINE_KEYS if k not in cls.reads
        )
        if ignored:
            keys = ", ".join(f"speculative_config.{k}" for k in ignored)
            reads = ", ".join(sorted(cls.reads)) or "no other key"
            raise ConfigError(
                f"{keys}: method {config.method!r} does not read it (it reads {reads}); drop it",
                param=f"speculative_config.{ignored[0]}",
            )

    @classmethod
    def check_engine(cls, args: EngineArgs) -> None:
        """Refuse engine settings the method cannot run with (ConfigError naming the setting);
        called before the target model loads. Nothing by default."""

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Draft tokens for each request, in order: at most ``max_tokens`` each, ``[]`` for none."""

    def observe(self, step, result) -> None:
        """What the target computed in a step (``step``: its
        :class:`~fastdeploy_core.executor.step_io.SchedulerOutput`, ``result``: the
        :class:`~fastdeploy_core.executor.step_io.RunnerOutput`, with ``hidden_states`` when
        :attr:`wants_hidden_states`), called after every step before the engine applies it.
        Nothing by default."""

    def forget(self, request_id: str) -> None:
        """The request finished, was aborted or was preempted: drop any state kept for it (none
        by default). A preempted request may ask for drafts again later, from scratch."""

    def close(self) -> None:
        """Free what the proposer holds (a model, a cache) now, as ``LLM.close()`` does for the
        target; none by default. The proposer is not used afterwards."""

    def describe(self) -> dict[str, Any]:
        """Settings for ``/config-info``."""
        shown = {"method", "num_speculative_tokens", *self.reads}
        if self.config.disable_by_batch_size is not None:
            shown.add("disable_by_batch_size")
        return self.config.model_dump(include=shown)


def pack_chunks(rows: list, budget: int, remaining) -> list[tuple[Any, int]]:
    """The next step of a proposer's catch-up: ``(row, n)`` for the leading ``rows``, each taking
    ``min(remaining(row), what is left of budget)`` tokens, until the step's token budget is spent."""
    step = []
    for row in rows:
        if budget <= 0:
            break
        n = min(remaining(row), budget)
        step.append((row, n))
        budget -= n
    return step
