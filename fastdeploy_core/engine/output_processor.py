"""Token ids -> text, where the tokenizer lives (the API process for the server).

:class:`OutputProcessor` keeps one incremental detokenizer per choice of each request, applies
stop strings (also when a stop string spans several tokens), honours
``include_stop_str_in_output`` and ``min_tokens``, and returns :class:`RequestOutput` objects
carrying cumulative text plus the delta since the previous output.

Stop strings are found here, not in the engine core, so the core must be told: every choice
ended by a stop string is listed in :attr:`ProcessedOutputs.reqs_to_abort` (as an id the core's
``abort_requests`` accepts) and the caller passes that list on. While a stop string could still
be forming, up to ``len(longest stop string) - 1`` trailing characters are held back from the
deltas so streamed text never has to be retracted.

Usage::

    processor = OutputProcessor(tokenizer)
    processor.add_request(request_id, prompt, prompt_token_ids, sampling_params)
    core.add_request(EngineCoreRequest(request_id, prompt_token_ids, sampling_params))
    while ...:
        processed = processor.process_outputs(core.step())
        core.abort_requests(processed.reqs_to_abort)
        for out in processed.request_outputs: ...
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastdeploy_core.engine.outputs import (
    CompletionOutput,
    CompletionOutputs,
    EngineCoreOutput,
    RequestMetrics,
    RequestOutput,
    choice_request_id,
)
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.errors import InvalidRequestError

#: Prompt tokens kept in front of the output so the first output token decodes with its
#: leading space (sentencepiece / byte-level tokenizers strip a leading space otherwise).
_PROMPT_CONTEXT_TOKENS = 5


@dataclass
class ProcessedOutputs:
    """The result of one :meth:`OutputProcessor.process_outputs` call."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    #: Core request ids the caller must pass to ``EngineCore.abort_requests`` (stop strings).
    reqs_to_abort: list[str] = field(default_factory=list)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is still pending (an incomplete character decodes as U+FFFD)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new_text[len(prefix_text) :]
        if final:
            self.read_offset = len(self.ids)
        return ""


@dataclass
class _Choice:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    text: str = ""
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_Choice]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


class OutputProcessor:
    """Detokenizes engine-core outputs and applies stop strings; see the module docstring."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def prepare_sampling_params(self, params: SamplingParams) -> SamplingParams:
        """Fill ``bad_words_token_ids`` from ``bad_words`` (the core has no tokenizer).

        Each word is banned as written and with a leading space, as tokenizers split both ways.
        """
        if params.bad_words and params.bad_words_token_ids is None:
            seqs: list[list[int]] = []
            for word in params.bad_words:
                for variant in (word, " " + word.lstrip()):
                    ids = list(self.tokenizer.encode(variant, add_special_tokens=False))
                    if ids and ids not in seqs:
                        seqs.append(ids)
            params.bad_words_token_ids = seqs
        return params

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Start tracking a request. Also fills ``sampling_params.bad_words_token_ids``
        (see :meth:`prepare_sampling_params`), so call it before sending the request to the core."""
        if request_id in self._requests:
            raise InvalidRequestError(
                f"request id {request_id!r} is already in use; use a unique id", param="request_id"
            )
        self.prepare_sampling_params(sampling_params)
        choices = [
            _Choice(i, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sampling_params.skip_special_tokens))
            for i in range(sampling_params.n)
        ]
        if sampling_params.logprobs is not None:
            for choice in choices:
                choice.logprobs = []
        metrics = RequestMetrics(
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            num_prompt_tokens=len(prompt_token_ids),
        )
        self._requests[request_id] = _RequestState(
            request_id, prompt, list(prompt_token_ids), sampling_params, choices, metrics
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop tracking ``request_id``; its unfinished choices end with ``"abort"``."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        for choice in state.choices:
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
        state.metrics.finish_time = time.time()
        return self._make_output(state)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step's core outputs; one RequestOutput per request touched."""
        result = ProcessedOutputs()
        touched: dict[str, _RequestState] = {}
        now = time.time()
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None or not 0 <= out.index < len(state.choices):
                continue  # aborted or finished by a stop string already
            choice = state.choices[out.index]
            if choice.finish_reason is not None:
                continue
            touched[state.request_id] = state
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = out.prompt_logprobs
            if out.new_token_ids:
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = now
                state.metrics.last_token_time = now
            if self._apply(state, choice, out):
                result.reqs_to_abort.append(choice_request_id(state.request_id, choice.index, len(state.choices)))
        for state in touched.values():
            result.request_outputs.append(self._make_output(state))
            if state.finished:
                state.metrics.finish_time = now
                self._requests.pop(state.request_id, None)
        return result

    def _apply(self, state: _RequestState, choice: _Choice, out: EngineCoreOutput) -> bool:
        """Add ``out``'s tokens to ``choice``; True when a stop string ended it (core must abort)."""
        params = state.params
        stops = params.stop or []
        for k, token_id in enumerate(out.new_token_ids):
            choice.token_ids.append(token_id)
            state.metrics.num_generated_tokens += 1
            if choice.logprobs is not None and out.new_logprobs and k < len(out.new_logprobs):
                choice.logprobs.append(out.new_logprobs[k])
            before = len(choice.text)
            choice.text += choice.detokenizer.push(token_id)
            if stops and len(choice.token_ids) > params.min_tokens and len(choice.text) > before:
                hit = self._find_stop(choice.text, before, stops)
                if hit is not None:
                    pos, stop = hit
                    choice.text = choice.text[: pos + (len(stop) if params.include_stop_str_in_output else 0)]
                    choice.finish_reason = "stop"
                    choice.stop_reason = stop
                    return not out.finished
        if out.finished:
            choice.text += choice.detokenizer.flush()
            choice.finish_reason = out.finish_reason or "stop"
            choice.stop_reason = out.stop_reason
        return False

    @staticmethod
    def _find_stop(text: str, new_from: int, stops: list[str]) -> tuple[int, str] | None:
        """Earliest stop string that ends inside ``text[new_from:]``; of two starting at the
        same place (one is a prefix of the other), the shorter, which ends first."""
        best: tuple[int, str] | None = None
        for stop in stops:
            pos = text.find(stop, max(0, new_from - len(stop) + 1))
            if pos != -1 and (best is None or (pos, len(stop)) < (best[0], len(best[1]))):
                best = (pos, stop)
        return best

    def _make_output(self, state: _RequestState) -> RequestOutput:
        params = state.params
        holdback = 0
        if params.stop and not params.include_stop_str_in_output:
            holdback = max(len(s) for s in params.stop) - 1
        completions = []
        for choice in state.choices:
            upto = (
                len(choice.text)
                if choice.finish_reason is not None
                else max(choice.sent_text, len(choice.text) - holdback)
            )
            delta_text = choice.text[choice.sent_text : upto]
            choice.sent_text = max(choice.sent_text, upto)
            delta_ids = choice.token_ids[choice.sent_tokens :]
            choice.sent_tokens = len(choice.token_ids)
            delta_logprobs = None
            if choice.logprobs is not None:
                delta_logprobs = choice.logprobs[choice.sent_logprobs :]
                choice.sent_logprobs = len(choice.logprobs)
            completions.append(
                CompletionOutput(
                    index=choice.index,
                    text=choice.text[:upto],
                    token_ids=list(choice.token_ids),
                    logprobs=list(choice.logprobs) if choice.logprobs is not None else None,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                    delta_text=delta_text,
                    delta_token_ids=delta_ids,
                    delta_logprobs=delta_logprobs,
                )
            )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=CompletionOutputs(completions),
            finished=state.finished,
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=state.prompt_logprobs,
        )
