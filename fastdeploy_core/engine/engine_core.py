"""The engine core: scheduler + block manager + model runner, driven one step at a time.

It runs in-process (``LLM``, :class:`~fastdeploy_core.engine.llm_engine.LLMEngine`) or inside
the server's engine process. It sees token ids only; text lives in the
:class:`~fastdeploy_core.engine.output_processor.OutputProcessor` next to the tokenizer.

API (stable; the server's engine process is built on it)::

    core = EngineCore(args)                      # EngineArgs; loads the model, sizes the KV cache
    core.add_request(EngineCoreRequest(request_id, prompt_token_ids, sampling_params,
                                       arrival_time=None, priority=0))
                                                 # validates: ContextLengthExceededError,
                                                 # InvalidRequestError (nothing is queued then)
    outputs = core.step()                        # list[EngineCoreOutput]: one per choice that got
                                                 # tokens or finished in this step
    core.abort_requests([request_id, ...])       # frees KV blocks now; no output is emitted
    core.has_unfinished_requests() -> bool
    core.capacity() -> Capacity                  # free slots / blocks and step budget, for the
                                                 # request-level scheduler (fastdeploy_core.scheduler)
    core.get_stats() -> dict                     # running/waiting, blocks, cache usage, prefix hits,
                                                 # prompt/generation token totals, preemptions
    core.config_info() -> dict                   # resolved settings (blocks, max_model_len, device…)
    core.max_model_len, core.model_source, core.eos_token_ids

``EngineCoreRequest`` / ``EngineCoreOutput`` (in :mod:`fastdeploy_core.engine.outputs`) are
plain dataclasses of builtins. A request with ``sampling_params.n > 1`` runs as ``n`` choices
(core ids ``"{request_id}#{i}"``, seeds ``seed + i``); outputs carry the user's ``request_id``
and the choice ``index``; ``abort_requests`` takes a request id (every choice) or a choice id.
Finishing on eos / ``stop_token_ids`` / ``max_tokens`` / ``max_model_len`` happens here; stop
strings are found by the OutputProcessor, whose ``reqs_to_abort`` the caller passes back to
``abort_requests``.

:func:`validate_prompt` is the same check ``add_request`` does, for the API process to
answer 400 before queuing.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.engine import guided_steps
from fastdeploy_core.engine.block_manager import BlockManager
from fastdeploy_core.engine.outputs import EngineCoreOutput, EngineCoreRequest, choice_request_id
from fastdeploy_core.engine.request import Request, RequestStatus
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.engine.scheduler import Scheduler, chunk_cost
from fastdeploy_core.errors import ConfigError, ContextLengthExceededError, InvalidRequestError
from fastdeploy_core.scheduler.base import Capacity


def validate_prompt(
    prompt_token_ids: list[int],
    sampling_params: SamplingParams | None,
    max_model_len: int,
    vocab_size: int | None = None,
) -> None:
    """Raise a typed 400 error if the prompt cannot be served (nothing else is checked here)."""
    if not prompt_token_ids:
        raise InvalidRequestError(
            "the prompt is empty; send at least one token of text (or prompt_token_ids)", param="prompt"
        )
    n = len(prompt_token_ids)
    if n >= max_model_len:
        raise ContextLengthExceededError(
            f"the prompt has {n} tokens but max_model_len is {max_model_len} (the prompt must leave room "
            f"for at least one generated token); shorten the prompt to at most {max_model_len - 1} tokens "
            "or raise --max-model-len",
            param="prompt",
        )
    if vocab_size:
        bad = [t for t in prompt_token_ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt_token_ids holds {len(bad)} id(s) outside the vocabulary [0, {vocab_size}) "
                f"(first: {bad[0]!r}); send token ids of this model's tokenizer",
                param="prompt_token_ids",
            )
    if sampling_params is not None:
        sampling_params.validate()


MIX_PREFILL_DECODE_ENV = "FD_MIX_PREFILL_DECODE"
#: How long one step of prompt work should take while other requests share the engine ...
PROMPT_STEP_TARGET_S = 0.5
#: ... and at least this many decode steps' time, so the decode steps between prompt steps
#: delay a burst's later prompts by a fraction of their own time.
PROMPT_STEP_DECODE_RATIO = 4.0
#: ``FD_PROMPT_STEP_TARGET_MS``: overrides the target; 0 turns the prompt step cap off.
PROMPT_STEP_TARGET_ENV = "FD_PROMPT_STEP_TARGET_MS"
#: The smallest prompt step the cap allows, and the fewest prompt tokens a step must have to be
#: measured: on the cpu device, prompt steps of 64-256 tokens cost up to twice the time per token
#: of larger ones (their GEMMs ran on one of the 2 cores), so smaller steps lose throughput.
PROMPT_STEP_MIN_TOKENS = 256
#: The share of ``min_tokens`` a prompt step must reach to be measured (see ``PromptStepSizer.observe``).
MEASURED_SHARE = 0.9


class PromptStepSizer:
    """The scheduler's ``prompt_token_cap`` from measured step times.

    A burst of prompts computed in one step makes every one of them wait for the whole step
    (16 prompts of 64 tokens: ~2 s on the cpu device) and holds every decode back as long.
    Sized to about ``target_s`` of work, or ``decode_ratio`` decode steps when those take
    longer, prompt steps let the first requests of a burst start answering early. The time per
    prompt token is a moving average over steps with at least ``min_tokens`` prompt tokens
    (their fixed cost per step is amortised; it follows the machine's load), the decode step
    time one over steps without prompt work; until a prompt step is seen the cap is
    ``min_tokens``. The cap stays within ``[min_tokens, max_tokens]``.
    """

    def __init__(
        self,
        target_s: float,
        min_tokens: int,
        max_tokens: int,
        decode_ratio: float = PROMPT_STEP_DECODE_RATIO,
        smoothing: float = 0.3,
    ):
        self.target_s = target_s
        self.decode_ratio = decode_ratio
        self.decode_seconds: float | None = None
        self.min_tokens = max(1, min(min_tokens, max_tokens))
        self.max_tokens = max_tokens
        self.smoothing = smoothing
        self.seconds_per_token: float | None = None

    @classmethod
    def from_env(cls, min_tokens: int, max_tokens: int) -> PromptStepSizer | None:
        """The default sizer, or the one ``FD_PROMPT_STEP_TARGET_MS`` asks for; None when it is 0."""
        raw = os.environ.get(PROMPT_STEP_TARGET_ENV, "").strip()
        target = PROMPT_STEP_TARGET_S
        if raw:
            try:
                target = float(raw) / 1000
            except ValueError:
                raise ConfigError(
                    f"{PROMPT_STEP_TARGET_ENV}={raw!r} is not a number of milliseconds (0 turns the cap off)"
                ) from None
        return cls(target, min_tokens, max_tokens) if target > 0 else None

    @property
    def cap(self) -> int:
        if not self.seconds_per_token:
            return self.min_tokens
        target = max(self.target_s, self.decode_ratio * (self.decode_seconds or 0.0))
        return int(min(self.max_tokens, max(self.min_tokens, target / self.seconds_per_token)))

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def observe(self, prompt_tokens: float, total_tokens: float, seconds: float) -> None:
        """One step that computed ``prompt_tokens`` prompt tokens (``total_tokens`` in all) in
        ``seconds``; or both as costs in the scheduler's ``chunk_cost`` units, which the cap is
        then counted in. A prompt step is measured from ``MEASURED_SHARE`` of ``min_tokens``: a
        step capped at ``min_tokens`` units falls short of it by less than one token's cost."""
        if total_tokens <= 0 or seconds <= 0:
            return
        if prompt_tokens == 0:
            self.decode_seconds = self._average(self.decode_seconds, seconds)
        elif prompt_tokens >= MEASURED_SHARE * self.min_tokens:
            self.seconds_per_token = self._average(self.seconds_per_token, seconds / total_tokens)


def attention_key_weight(hf_config: dict) -> float:
    """What one query token attending to one key costs, in units of one token's other work:
    the attention FLOPs of a (query, key) pair (4 * heads * head_dim per layer: scores and
    weighted values) over a token's linear-layer FLOPs (2 per weight of the projections, the
    MLP of its active experts, and the LM head). 0 when the config lacks the sizes.

    The scheduler's prompt cap counts chunks in these units (``Scheduler.attention_key_weight``):
    SmolLM2-135M's weight is ~2.6e-4, so a prompt token at 8,000 tokens of context costs ~3
    tokens at its start, and chunks beside running decodes shrink accordingly.
    """
    try:
        hidden = int(hf_config["hidden_size"])
        layers = int(hf_config["num_hidden_layers"])
        heads = int(hf_config["num_attention_heads"])
        kv_heads = int(hf_config.get("num_key_value_heads") or heads)
        head_dim = int(hf_config.get("head_dim") or hidden // heads)
        experts = int(hf_config.get("num_experts_per_tok") or 1)
        ffn = int(hf_config.get("moe_intermediate_size") or hf_config["intermediate_size"]) * experts
        vocab = int(hf_config.get("vocab_size") or 0)
    except (KeyError, TypeError, ValueError):
        return 0.0
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * ffn
    linear_flops = 2 * (layers * per_layer + hidden * vocab)
    return 4 * heads * head_dim * layers / linear_flops if linear_flops > 0 else 0.0


def mixes_prefill_and_decode(ops) -> bool:
    """Whether steps may hold prompt chunks and decodes together.

    Only when the device's ops table says its attention costs what the real query rows cost
    however a batch mixes them (``ragged_attention = True``, varlen kernels). The attention
    of the reference and fused ops pads every sequence of a step to the longest query run, so
    a prompt chunk beside many decodes costs several times the two steps run apart
    (see :mod:`fastdeploy_core.engine.scheduler`). ``FD_MIX_PREFILL_DECODE=1`` / ``=0``
    overrides the device's answer (for experiments).
    """
    forced = os.environ.get(MIX_PREFILL_DECODE_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return bool(getattr(ops, "ragged_attention", False))


class EngineCore:
    """See the module docstring."""

    def __init__(self, args: EngineArgs, plugin_manager=None):
        from fastdeploy_core.executor.model_runner import ModelRunner
        from fastdeploy_core.executor.tensor_parallel import TensorParallelRunner

        self.args = args
        runner_kw = {}
        if args.speculative.enabled:  # an unknown method or settings it cannot run with: refused before loading
            from fastdeploy_core.spec_decode import proposer_class

            if proposer_class(args.speculative, plugin_manager, args).uses_mtp_cache:
                runner_kw["with_mtp_cache"] = True  # its blocks hold the MTP layers' rows as well
        runner_cls = TensorParallelRunner if args.parallel.tensor_parallel_size > 1 else ModelRunner
        self.runner = runner_cls(args, plugin_manager, **runner_kw)
        self.model_source = self.runner.source
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.block_manager = BlockManager(
            self.runner.num_blocks, args.cache.block_size, args.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=args.scheduler.max_num_seqs,
            max_num_batched_tokens=self.runner.max_num_batched_tokens,
            enable_chunked_prefill=args.scheduler.enable_chunked_prefill,
            policy=args.scheduler.policy,
            mix_prefill_decode=mixes_prefill_and_decode(self.runner.ops),
            prompt_block_share=args.cache.kv_cache_ratio or 1.0,
        )
        self.prompt_sizer = PromptStepSizer.from_env(
            min(PROMPT_STEP_MIN_TOKENS, self.runner.max_num_batched_tokens), self.runner.max_num_batched_tokens
        )
        if self.prompt_sizer is not None:
            self.scheduler.prompt_token_cap = self.prompt_sizer.cap
            self.scheduler.attention_key_weight = attention_key_weight(self.model_source.hf_config)
        self.eos_token_ids = self._model_eos_ids()
        from fastdeploy_core.spec_decode import build_proposer

        self.proposer = build_proposer(
            args, self.vocab_size, self.max_model_len, plugin_manager, num_blocks=self.runner.num_blocks,
            runner=self.runner,
        )
        self._seed_sequence = np.random.SeedSequence(args.model.seed)
        self._choices: dict[str, list[str]] = {}  # request id -> core ids of its choices
        self._parent: dict[str, str] = {}  # core id -> request id
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_requests_finished = 0
        self.num_requests_aborted = 0
        self.guided = self._guided_decoder(args)

    def _guided_decoder(self, args: EngineArgs):
        """The grammar compiler of ``--guided-decoding-backend`` (None when off); its worker
        thread starts loading the tokenizer now, so the first constrained request waits less."""
        from fastdeploy_core.guided.manager import GuidedDecoder
        from fastdeploy_core.guided.registry import guided_backend_class

        backend_cls = guided_backend_class(args.structured.guided_decoding_backend)
        if backend_cls is None:
            return None
        from fastdeploy_core.tokenizer import load_tokenizer

        source = self.model_source
        return GuidedDecoder(backend_cls, lambda: load_tokenizer(source), self.vocab_size, self.eos_token_ids)

    def _model_eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for cfg in (self.model_source.generation_config, self.model_source.hf_config):
            value = cfg.get("eos_token_id")
            for tok in value if isinstance(value, list) else [value]:
                if isinstance(tok, int) and tok not in ids:
                    ids.append(tok)
        return tuple(ids)

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Validate and queue ``req`` (all its choices); typed errors leave nothing behind."""
        params, requests = self._sequences(req)
        for request in requests:
            self.scheduler.add_request(request)
        self._register(req, params, requests)

    def _sequences(self, req: EngineCoreRequest) -> tuple[SamplingParams, list[Request]]:
        """The validated params and one engine :class:`Request` per choice of ``req``."""
        params = req.sampling_params
        if isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        if params is None:
            params = SamplingParams()
        validate_prompt(req.prompt_token_ids, params, self.max_model_len, self.vocab_size)
        if params.guided_decoding is not None and self.guided is None:
            raise InvalidRequestError(
                "structured output is off on this engine (--guided-decoding-backend off); start it with "
                "--guided-decoding-backend auto to constrain outputs",
                param="guided_decoding",
            )
        if req.request_id in self._choices or req.request_id in self._parent:
            raise InvalidRequestError(
                f"request id {req.request_id!r} is already running; use a unique id", param="request_id"
            )
        prompt = [int(t) for t in req.prompt_token_ids]
        max_total = self.max_model_len
        if params.max_tokens is not None:
            max_total = min(max_total, len(prompt) + params.max_tokens)
        arrival = req.arrival_time if req.arrival_time is not None else time.time()
        requests: list[Request] = []
        for index in range(params.n):
            choice_params = params.child(index) if params.n > 1 else params
            eos = set(choice_params.stop_token_ids or ())
            if not choice_params.ignore_eos:
                eos.update(self.eos_token_ids)
            if choice_params.seed is not None:
                sample_seed = int(choice_params.seed)
            else:
                sample_seed = int(self._seed_sequence.spawn(1)[0].generate_state(1, np.uint64)[0])
            request = Request(
                request_id=choice_request_id(req.request_id, index, params.n),
                prompt_token_ids=prompt,
                sampling_params=choice_params,
                arrival_time=arrival,
                priority=req.priority,
                parent_id=req.request_id,
                index=index,
                eos_token_ids=tuple(sorted(eos)),
                max_total_tokens=max_total,
                sample_seed=sample_seed,
            )
            if choice_params.guided_decoding is not None:
                request.guided = self.guided.new_request(choice_params.guided_decoding)
            requests.append(request)
        return params, requests

    def _register(self, req: EngineCoreRequest, params: SamplingParams, requests: list[Request]) -> None:
        for request in requests:
            self._parent[request.request_id] = req.request_id
        self._choices[req.request_id] = [r.request_id for r in requests]
        self.num_prompt_tokens_total += len(req.prompt_token_ids) * params.n

    # ---- prompts computed by another instance (prefill/decode disaggregation) ----------------
    def reserve_remote(self, req: EngineCoreRequest) -> Request | None:
        """A decode instance's side of a disaggregated request (one choice): its sequence, with
        blocks held for the whole prompt (their ids: ``block_table``), or None when the free
        blocks do not hold the prompt now. Its prompt KV is written into those blocks from
        outside, then :meth:`admit_remote` hands it the first token."""
        params, requests = self._sequences(req)
        (request,) = requests
        if not self.scheduler.reserve(request):
            return None
        self._register(req, params, requests)
        return request

    def add_remote_prompt(self, request_id: str, prompt_token_ids: list[int], sampling_params: dict,
                          sample_seed: int) -> None:
        """A prefill instance's side: compute a decode instance's prompt and sample its first token
        as the decode instance would (its ``sample_seed``; ``min_tokens`` matters only as far as
        the first token). The request ends after that one token."""
        params = SamplingParams.from_dict(dict(sampling_params))
        if params.n != 1:
            raise InvalidRequestError("a disaggregated request has one choice", param="n")
        params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1),
                                     seed=int(sample_seed))
        self.add_request(EngineCoreRequest(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                                           sampling_params=params))

    def admit_remote(self, request: Request, token: int, logprobs=None, num_cached_tokens: int = 0) -> EngineCoreOutput:
        """The reserved ``request``'s prompt KV is in its blocks: it joins the batch with
        ``token`` (sampled where the prompt was computed) as its first output."""
        finished = self.scheduler.admit_prefilled(request, token)
        request.num_cached_tokens = num_cached_tokens
        self.num_generation_tokens_total += 1
        if finished:
            self.num_requests_finished += 1
            self._forget(request)
        return EngineCoreOutput(
            request_id=request.parent_id, index=request.index, new_token_ids=[int(token)],
            new_logprobs=[logprobs] if logprobs is not None else None, finished=request.is_finished,
            finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
            num_cached_tokens=num_cached_tokens,
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        """End the given requests (or single choices) now and free their KV blocks."""
        core_ids: list[str] = []
        for rid in request_ids:
            if rid in self._choices:
                core_ids.extend(self._choices[rid])
            elif rid in self._parent:
                core_ids.append(rid)
        aborted = self.scheduler.finish_requests(core_ids, RequestStatus.FINISHED_ABORTED)
        self.num_requests_aborted += len(aborted)
        for req in aborted:
            self._forget(req)

    def _forget(self, req: Request) -> None:
        if self.proposer is not None:
            self.proposer.forget(req.request_id)
        parent = self._parent.pop(req.request_id, None)
        if parent is None:
            return
        choices = self._choices.get(parent)
        if choices is not None and not any(c in self._parent for c in choices):
            del self._choices[parent]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def capacity(self) -> Capacity:
        """What the engine can take before its next step, for the request-level scheduler.

        Waiting requests (new or preempted) count against the free blocks with the blocks
        their tokens need, so requests are handed over only while they can start soon.
        """
        sched, bm = self.scheduler, self.block_manager
        promised = sum(bm.blocks_needed(req.num_tokens + 1) for req in sched.waiting)
        return Capacity(
            free_slots=max(0, sched.max_num_seqs - sched.num_running - sched.num_waiting - len(sched.reserved)),
            free_blocks=max(0, bm.num_free_blocks - promised),
            block_size=bm.block_size,
            token_budget=self.runner.max_num_batched_tokens,
            idle=not sched.requests,  # reserved requests (a decode instance's) hold blocks too
        )

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, sample, and report what changed."""
        failed = guided_steps.end_failed(self) if self.guided is not None else []
        batch = self.scheduler.schedule()
        if batch.is_empty:
            if self.guided is not None and not failed:
                guided_steps.wait_for_grammars(self)
            return failed
        if self.proposer is not None:
            for req in batch.preempted:  # recomputed later from scratch: its draft state goes now
                self.proposer.forget(req.request_id)
            self._add_drafts(batch)
        started = time.perf_counter()
        masks = guided_steps.bitmasks(self.guided, batch) if self.guided is not None else None
        step_input = batch.runner_input(masks)
        if self.proposer is not None:
            step_input.return_hidden_states = self.proposer.wants_hidden_states
        result = self.runner.execute_model(step_input)
        if self.proposer is not None:
            self.proposer.observe(step_input, result)
        if self.prompt_sizer is not None:
            # Both in the cap's units (chunk cost): a step the cap filled counts as measured.
            weight = self.scheduler.attention_key_weight
            prompt_cost = sum(chunk_cost(req.num_computed_tokens, n, weight) for req, n in batch.scheduled if n > 1)
            self.prompt_sizer.observe(prompt_cost, batch.cost(weight), time.perf_counter() - started)
            self.scheduler.prompt_token_cap = self.prompt_sizer.cap
        for (req, _), entries in zip(batch.scheduled, result.prompt_logprobs):
            if entries is not None:
                if req.prompt_logprobs is None:
                    req.prompt_logprobs = [None]
                req.prompt_logprobs.extend(entries)
        sampled = result.sampled_token_ids
        before = [req.num_output_tokens for req, _ in batch.scheduled]
        self.scheduler.update(batch, sampled, result.spec_token_ids)
        if masks is not None:
            guided_steps.advance(batch)
        outputs: list[EngineCoreOutput] = failed
        spec_logprobs = result.spec_logprobs or [None] * len(sampled)
        for (req, _), token, lp, spec_lps, num_before in zip(
            batch.scheduled, sampled, result.logprobs, spec_logprobs, before
        ):
            if token is None or req.status == RequestStatus.FINISHED_ABORTED:
                continue
            new_tokens = req.output_token_ids[num_before:]  # one, or several from accepted drafts
            if spec_lps is not None:
                new_logprobs = spec_lps[: len(new_tokens)]  # tokens after a stop were dropped
            else:
                new_logprobs = [lp] if lp is not None else None
            self.num_generation_tokens_total += len(new_tokens)
            prompt_logprobs = None
            if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
                prompt_logprobs = req.prompt_logprobs
                req.prompt_logprobs_sent = True
            outputs.append(
                EngineCoreOutput(
                    request_id=req.parent_id,
                    index=req.index,
                    new_token_ids=new_tokens,
                    new_logprobs=new_logprobs,
                    prompt_logprobs=prompt_logprobs,
                    finished=req.is_finished,
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                    num_cached_tokens=req.num_cached_tokens,
                )
            )
            if req.is_finished:
                self.num_requests_finished += 1
                self._forget(req)
        return outputs

    def _add_drafts(self, batch) -> None:
        """Speculative decoding: the proposer's guesses for the decode rows that may speculate,
        scheduled into this step (see :meth:`Scheduler.add_drafts`)."""
        from fastdeploy_core.spec_decode import DraftRequest

        limit = self.args.speculative.disable_by_batch_size
        if limit is not None and self.scheduler.num_running > limit:
            return  # a batch this large is compute-bound: drafts would cost more than they save
        candidates = self.scheduler.draft_candidates(batch, self.args.speculative.num_speculative_tokens)
        if not candidates:
            return
        asks = []
        for index, most in candidates:
            req = batch.scheduled[index][0]
            asks.append(DraftRequest(req.request_id, req.all_token_ids, req.num_prompt_tokens, most, req.block_table))
        drafts = self.proposer.propose(asks)
        self.scheduler.add_drafts(
            batch, {index: tokens[:most] for (index, most), tokens in zip(candidates, drafts) if tokens}
        )

    # ---- introspection ---------------------------------------------------------------------
    def get_stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            "cache_usage": bm.usage,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "prefix_cache_query_tokens": bm.prefix_query_tokens,
            "prefix_cache_hit_tokens": bm.prefix_hit_tokens,
            "prompt_tokens_total": self.num_prompt_tokens_total,
            "generation_tokens_total": self.num_generation_tokens_total,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_requests_finished": self.num_requests_finished,
            "num_requests_aborted": self.num_requests_aborted,
            **self.speculative_stats(),
        }

    def speculative_stats(self) -> dict:
        """Speculative decoding counters (FastDeploy's ``spec_decode_*`` metric names); empty
        when it is off. Emitted tokens are accepted drafts plus the target's own token of each
        speculating row; the mean accepted length is emitted tokens per speculating row-step."""
        if self.proposer is None:
            return {}
        sched = self.scheduler
        proposed, accepted, rows = sched.num_draft_tokens, sched.num_accepted_tokens, sched.num_speculative_rows
        return {
            "spec_decode_method": self.args.speculative.method,
            "spec_decode_num_draft_tokens_total": proposed,
            "spec_decode_num_accepted_tokens_total": accepted,
            "spec_decode_num_emitted_tokens_total": accepted + rows,
            "spec_decode_draft_acceptance_rate": accepted / proposed if proposed else 0.0,
            "spec_decode_mean_accepted_length": (accepted + rows) / rows if rows else 0.0,
        }

    def config_info(self) -> dict:
        info = self.runner.describe()
        try:
            weights = sum(int(t.numel()) * t.element_size() for t in self.runner.model.state_dict().values())
        except Exception:  # noqa: BLE001 - informative only
            weights = None
        info.update(
            weight_bytes=weights,
            max_num_seqs=self.args.scheduler.max_num_seqs,
            enable_chunked_prefill=self.args.scheduler.enable_chunked_prefill,
            enable_prefix_caching=self.args.cache.enable_prefix_caching,
            policy=self.args.scheduler.policy,
            eos_token_ids=list(self.eos_token_ids),
            generation_config=dict(self.model_source.generation_config),
            speculative_config=self.proposer.describe() if self.proposer is not None else None,
        )
        return info
