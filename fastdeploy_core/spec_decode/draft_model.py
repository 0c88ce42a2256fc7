"""``draft_model``: a smaller (or more coarsely quantized) model guesses the target's next tokens.

``--speculative-config '{"method": "draft_model", "num_speculative_tokens": K, "model": PATH,
"quantization": "wint4"}'``. The draft is any checkpoint the engine can load (an HF directory
or a ``.gguf`` file) that shares the target's vocabulary and tokenizer; without ``model`` it is
the target's own checkpoint loaded with ``quantization`` (a *self-draft*: the same weights,
quantized, so it agrees with the target most of the time at a fraction of the cost). One of the
two must be given: a draft identical to the target would cost a full target step per guess.

The draft runs a :class:`~fastdeploy_core.executor.model_runner.ModelRunner` of its own, with
its own paged KV cache and its own block pool (this module's free list, not the engine's block
manager: the draft's blocks never enter the prefix cache and never make the target preempt).
The pool holds as many blocks as the target's, so the draft can keep every request the target
holds; the cpu device commits cache pages only as they are written, so the pool costs memory in
proportion to what the speculating requests use. When the pool runs dry anyway, a request gets
no draft that step (its state is dropped; it catches up again later).

Per request the proposer remembers the tokens whose K/V its cache holds (``fed``: the
context's tokens and the drafts it fed itself). After each target step (:meth:`observe`) it
computes the prompt chunks the target computed in that step (requests without a grammar), so
the prompt's cost falls in the time to the first token, as the target's own does, and a
request's first speculative step feeds the draft one token, not its whole prompt. Each step it:

1. rewinds to the longest prefix of ``fed`` that the request's tokens still agree with: rejected
   drafts are simply forgotten (their cache slots are written over by the next tokens);
2. catches up on the tokens it has not computed (the prompt on the first step, in chunks of the
   step budget; afterwards the accepted drafts and the target's own token), which gives its
   first guess; past the prompts, a last catch-up step whose rows differ in length is padded to
   the longest one (the shorter rows compute their last cached tokens again) so that it, like
   the one-token steps of 3., replays a captured graph of the draft's runner;
3. feeds each guess back, one token per step for every drafting request at once, until it has
   ``max_tokens`` guesses (greedy argmax of the draft's logits).

:meth:`forget` (the request finished, was aborted or preempted) returns its blocks to the pool.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from fastdeploy_core.config import EngineArgs, QuantizationConfig, SpeculativeConfig
from fastdeploy_core.errors import ConfigError, FastDeployError, ModelLoadError
from fastdeploy_core.executor.step_io import ScheduledRequest, SchedulerOutput
from fastdeploy_core.spec_decode.base import DraftRequest, Proposer, ProposerContext, pack_chunks

logger = logging.getLogger(__name__)


class _Greedy:
    """The sampling settings of a draft row: a plain argmax (``SamplingSpec``)."""

    logprobs = None
    prompt_logprobs = None
    presence_penalty = 0.0
    frequency_penalty = 0.0
    bad_words_token_ids = None
    min_tokens = 0
    is_greedy = True
    _DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}

    def resolved(self, name: str) -> Any:
        return self._DEFAULTS[name]


GREEDY = _Greedy()


@dataclass
class _DraftState:
    """What the draft's cache holds for one request."""

    #: The tokens at the positions whose K/V the draft computed, in order.
    fed: list[int] = field(default_factory=list)
    #: How many leading tokens of ``fed`` are known to be the request's own (not guesses).
    confirmed: int = 0
    #: The draft cache's blocks, in position order.
    blocks: list[int] = field(default_factory=list)


@dataclass
class _Row:
    """One request's work inside a :meth:`DraftModelProposer.propose` call."""

    index: int  # in the call's request list
    request: DraftRequest
    state: _DraftState
    tokens: list[int]  # the request's tokens, then this call's guesses
    computed: int  # positions of ``tokens`` whose K/V the draft cache holds
    drafts: list[int] = field(default_factory=list)
    guesses: bool = True  # False: computing a prompt chunk, nothing sampled


def draft_engine_args(config: SpeculativeConfig, context: ProposerContext, num_blocks: int) -> EngineArgs:
    """The target's settings with the draft's checkpoint, quantization and cache size. A quantized
    draft stores its linear layers in its quantization's format, so it does not take the target's
    ``--dtype bfloat16`` (which is about the same layers); an unquantized draft does."""
    target = context.engine_args
    return target.model_copy(
        update={
            "model": target.model.model_copy(
                update={
                    "model": config.model if config.model is not None else target.model.model,
                    "max_model_len": context.max_model_len,
                    "served_model_name": None,
                    "dtype": target.model.dtype if config.quantization is None else "auto",
                }
            ),
            "cache": target.cache.model_copy(
                update={"num_gpu_blocks_override": num_blocks, "kv_cache_memory": None, "gpu_memory_utilization": None}
            ),
            "quant": QuantizationConfig(quantization=config.quantization),
            "speculative": SpeculativeConfig(),
        }
    )


class DraftModelProposer(Proposer):
    """Drafts with a model of its own (see the module docstring)."""

    reads = frozenset({"model", "quantization"})

    def __init__(self, config: SpeculativeConfig, context: ProposerContext):
        super().__init__(config, context)
        if config.model is None and config.quantization is None:
            raise ConfigError(
                "speculative_config: method 'draft_model' needs a draft: give speculative_config.model (a smaller "
                'checkpoint sharing the target\'s vocabulary) or speculative_config.quantization (e.g. "wint4": the '
                "target's own checkpoint, quantized); the target itself as its own draft would cost a full step "
                "per guess",
                param="speculative_config.model",
            )
        target = context.engine_args
        bs = target.cache.block_size
        per_sequence = math.ceil(context.max_model_len / bs)
        most = per_sequence * target.scheduler.max_num_seqs
        self.num_blocks = max(per_sequence, min(most, context.num_blocks or most))
        self.runner = self._load(draft_engine_args(config, context, self.num_blocks))
        self._check_vocabulary()
        self.shares_target_head = self._share_target_head()
        self.block_size = self.runner.block_size
        self.max_num_batched_tokens = self.runner.max_num_batched_tokens
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # pop() takes block 0 first
        self._states: dict[str, _DraftState] = {}
        logger.info(
            "speculative draft: %s (quantization %s), its own KV cache of %d blocks, graph capture: %s",
            self.runner.source.path, config.quantization or "as stored", self.num_blocks,
            self.runner.describe()["graph_capture"],
        )

    # ---- loading ---------------------------------------------------------------------------
    def _load(self, args: EngineArgs):
        from fastdeploy_core.devices.current import current_ops, set_current_ops
        from fastdeploy_core.executor.model_runner import ModelRunner

        target_ops = current_ops()  # the draft's runner installs its own table; the target's goes back
        try:
            return ModelRunner(args, self.context.plugin_manager)
        except FastDeployError as exc:
            if exc.param == "quantization":
                key = "quantization"
            elif self.config.model is not None:
                key = "model"
            else:
                raise
            raise ConfigError(
                f"speculative_config.{key}: the draft model could not be set up: {exc.message}",
                param=f"speculative_config.{key}",
            ) from exc
        finally:
            set_current_ops(target_ops)

    def _check_vocabulary(self) -> None:
        """Refuse a draft whose token ids mean other tokens than the target's."""
        if self.runner.vocab_size != self.context.vocab_size:
            raise ConfigError(
                f"speculative_config.model: the draft's vocabulary has {self.runner.vocab_size} tokens, the target's "
                f"{self.context.vocab_size}; a draft must share the target's vocabulary and tokenizer",
                param="speculative_config.model",
            )
        if self.config.model is None:
            return  # a self-draft: the same checkpoint
        from fastdeploy_core.loader import resolve_model_source

        target = self._vocabulary(resolve_model_source(self.context.engine_args.model.model))
        draft = self._vocabulary(self.runner.source)
        if target != draft:
            if target is None or draft is None:
                which = "target" if target is None else "draft"
                why = f"the {which} has no tokenizer to compare"
            else:
                differ = sorted(set(target.items()) ^ set(draft.items()))
                why = f"their tokenizers map {len(differ)} token(s) differently (e.g. {differ[0][0]!r})"
            raise ConfigError(
                f"speculative_config.model: the draft must share the target's tokenizer, and {why}; use a draft "
                "trained with the target's tokenizer",
                param="speculative_config.model",
            )

    def _share_target_head(self) -> bool:
        """A self-draft takes the target's float32 LM head instead of its own quantized copy.

        The draft's guesses are argmaxes: the target's head answers them through the device's
        greedy head (``greedy_lm_head``: an int8 screen, then exact float32 logits for the few
        tiles that can hold the maximum), which reads as many bytes as a quantized head's int8
        codes but skips computing and writing most logits, and its argmax is the float32 one.
        So it is both cheaper per draft step and a closer copy of the target (AVX2 EPYC 7002,
        2026-12-03: 1.8 -> 1.5 ms per one-row draft step), and the draft keeps no head of its
        own. A draft of another checkpoint, a target head without greedy state (not float32,
        e.g. ``--dtype bfloat16``, or no int8 dot products on the CPU) or a head split over
        tensor-parallel ranks keeps the draft's own head."""
        from fastdeploy_core.layers.embedding import LMHead

        target = getattr(self.context.runner, "model", None)
        head = getattr(target, "lm_head", None)
        draft = self.runner.model
        if (
            self.config.model is not None
            or not isinstance(head, LMHead)
            or not isinstance(getattr(draft, "lm_head", None), LMHead)
            or head.greedy_state is None  # set only for a float32 head (UnquantizedLMHeadMethod)
            or head.tp_mode is not None
        ):
            return False
        draft.lm_head = head
        return True

    @staticmethod
    def _vocabulary(source) -> dict[str, int] | None:
        from fastdeploy_core.tokenizer import load_tokenizer

        try:
            tokenizer = load_tokenizer(source)
        except ModelLoadError:
            return None
        return tokenizer.backend.get_vocab(with_added_tokens=True)

    # ---- the pool --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def _reserve(self, state: _DraftState, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` positions; False (nothing taken) when the pool is short."""
        wanted = math.ceil(num_tokens / self.block_size) - len(state.blocks)
        if wanted <= 0:
            return True
        if wanted > len(self._free):
            return False
        state.blocks.extend(self._free.pop() for _ in range(wanted))
        return True

    def forget(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self._free.extend(reversed(state.blocks))

    # ---- proposing -------------------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        rows = [row for i, r in enumerate(requests) if r.max_tokens > 0 and (row := self._row(i, r)) is not None]
        # Catch up on the tokens the draft has not seen; a row's last chunk gives its first guess.
        pending = rows
        while pending:
            step = pack_chunks(pending, self.max_num_batched_tokens, lambda row: len(row.tokens) - row.computed)
            self._run(self._uniform(step))
            pending = [row for row in pending if not row.drafts]
        # Then each guess is fed back for the next one.
        while True:
            step = [(row, 1) for row in rows if len(row.drafts) < row.request.max_tokens]
            if not step:
                break
            self._run(step)
        out: list[list[int]] = [[] for _ in requests]
        for row in rows:
            out[row.index] = row.drafts
            row.state.fed = row.tokens[: row.computed]
            row.state.confirmed = len(row.request.token_ids)
        return out

    def observe(self, step, result) -> None:
        """Compute the prompt chunks the target computed in ``step`` (see the module docstring):
        rows still in their prompt, with no grammar mask (those never speculate)."""
        rows = []
        for sreq in step.requests:
            if sreq.draft_token_ids or sreq.token_bitmask is not None or sreq.num_computed_tokens >= sreq.num_prompt_tokens:
                continue
            end = min(sreq.num_computed_tokens + sreq.num_new_tokens, sreq.num_prompt_tokens)
            tokens = sreq.all_token_ids[:end]
            state = self._states.setdefault(sreq.request_id, _DraftState())
            computed = self._agreed(state, tokens)
            if computed >= end:
                continue
            if not self._reserve(state, end):
                self.forget(sreq.request_id)
                continue
            request = DraftRequest(sreq.request_id, tokens, sreq.num_prompt_tokens, 0)
            rows.append(_Row(len(rows), request, state, list(tokens), computed, guesses=False))
        pending = rows
        while pending:
            self._run(pack_chunks(pending, self.max_num_batched_tokens, lambda row: len(row.tokens) - row.computed))
            pending = [row for row in pending if row.computed < len(row.tokens)]
        for row in rows:
            row.state.fed = row.tokens
            row.state.confirmed = len(row.tokens)

    @staticmethod
    def _agreed(state: _DraftState, tokens: list[int]) -> int:
        """How many leading positions of the draft's cache hold ``tokens``."""
        fed, agreed = state.fed, state.confirmed
        limit = min(len(fed), len(tokens))
        while agreed < limit and fed[agreed] == tokens[agreed]:
            agreed += 1
        return min(agreed, len(tokens))

    def _row(self, index: int, request: DraftRequest) -> _Row | None:
        """The request's work this call, its cache rewound to what still agrees with its tokens."""
        state = self._states.setdefault(request.request_id, _DraftState())
        tokens = list(request.token_ids)
        agreed = self._agreed(state, tokens)
        # At least the last token is fed: its logits give the first guess.
        computed = min(agreed, len(tokens) - 1)
        # Positions up to the last guess fed back: len(tokens) - 1 + max_tokens - 1.
        if not self._reserve(state, len(tokens) + request.max_tokens - 1):
            self.forget(request.request_id)
            logger.debug("draft cache full: no draft for %s this step", request.request_id)
            return None
        return _Row(index, request, state, tokens, computed)

    def _uniform(self, step: list[tuple[_Row, int]]) -> list[tuple[_Row, int]]:
        """A last catch-up step whose rows are past their prompts but short of one another (after
        a verify step, a row whose drafts were all kept has 2 tokens to compute, the others 1),
        padded to the same ``q`` for every row when the draft's runner captures such steps: a row
        steps back over tokens its cache holds already and computes them again (same tokens, same
        positions), so the step replays a captured graph instead of running eagerly. Otherwise
        ``step`` as it is. The guesses only decide how many tokens the target keeps, never which."""
        graphs = self.runner.graphs
        q = max(n for _, n in step)
        if (
            graphs is None
            or len({n for _, n in step}) == 1
            or not graphs.may_capture(len(step), q)
            or q * len(step) > self.max_num_batched_tokens
        ):
            return step
        prompt = [row.request.num_prompt_tokens for row, _ in step]
        if any(row.computed + n != len(row.tokens) or row.computed - (q - n) < p for (row, n), p in zip(step, prompt)):
            return step  # a row still in its prompt, or not finishing its catch-up here
        for row, n in step:
            row.computed -= q - n
        return [(row, q) for row, _ in step]

    def _run(self, step: list[tuple[_Row, int]]) -> None:
        """One forward of the draft over ``(row, tokens to compute)``; a row that reaches the end
        of its tokens gets its next guess appended."""
        scheduled = []
        for row, n in step:
            scheduled.append(
                ScheduledRequest(
                    request_id=row.request.request_id,
                    all_token_ids=row.tokens,
                    num_prompt_tokens=row.request.num_prompt_tokens,
                    num_computed_tokens=row.computed,
                    num_new_tokens=n,
                    block_table=row.state.blocks,
                    sampling_params=GREEDY,
                    eos_token_ids=(),
                    sample_seed=None,
                    samples=row.guesses and row.computed + n == len(row.tokens),
                )
            )
        result = self.runner.execute_model(SchedulerOutput(scheduled))
        for (row, n), token in zip(step, result.sampled_token_ids):
            row.computed += n
            if token is not None:
                row.drafts.append(int(token))
                row.tokens.append(int(token))

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["draft"] = {
            "model": self.runner.source.path,
            "quantization": self.config.quantization,
            "kv_cache_blocks": self.num_blocks,
            "graph_capture": self.runner.describe()["graph_capture"],
            "lm_head": "the target's (float32, greedy head)" if self.shares_target_head else "its own",
        }
        return info

    def close(self) -> None:
        """Free the draft's captured steps, cache and weights now."""
        self._states.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self.runner.close()
