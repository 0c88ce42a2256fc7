"""What the engine hands back, with FastDeploy's field names.

Two layers:

* :class:`EngineCoreOutput` — plain builtins, one per request touched by a core step; crosses
  the engine-process boundary (pickle or ``to_dict`` for msgpack).
* :class:`RequestOutput` / :class:`CompletionOutput` / :class:`RequestMetrics` — what users get
  from ``LLM.generate`` and what the server turns into JSON / SSE, built by the
  :class:`~fastdeploy_core.engine.output_processor.OutputProcessor`.

Logprobs are ``list[dict[int, float]]``: one dict per token, the sampled token first, then the
top-N tokens by rank (log-softmax of the model's raw logits).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

Logprobs = list[dict[int, float]]


@dataclass
class EngineCoreRequest:
    """A request as the engine core receives it (already tokenized)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any  # SamplingParams (a dataclass of builtins)
    arrival_time: float | None = None
    priority: int = 0
    #: On a decode instance: the router's pairing (``disaggregation.pairing.parse_pairing``), whose
    #: prefill instance computes the prompt and writes its KV blocks into this instance's.
    disaggregate: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["sampling_params"] = self.sampling_params.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineCoreRequest:
        from fastdeploy_core.engine.sampling_params import SamplingParams

        data = dict(data)
        data["sampling_params"] = SamplingParams.from_dict(data["sampling_params"])
        return cls(**data)


@dataclass
class EngineCoreOutput:
    """New tokens of one choice of one request after a step.

    ``index`` is the choice (``n > 1``); ``finish_reason`` is ``"stop"`` (eos or a stop token,
    then ``stop_reason`` is the stop token id or None for eos), ``"length"`` or ``"abort"``.
    ``prompt_logprobs`` arrives once, with the first token: entry ``i`` belongs to prompt
    token ``i`` (entry 0 is None).
    """

    request_id: str
    index: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: Logprobs | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineCoreOutput:
        return cls(**data)


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()``) of one request, as seen where outputs are processed."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One choice. ``text`` / ``token_ids`` / ``logprobs`` are cumulative; the ``delta_*``
    fields hold what is new since the previous output of this request (for streaming)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: Logprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: Logprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class CompletionOutputs(list):
    """The choices of a request; FastDeploy-style attribute access reads choice 0.

    FastDeploy's ``RequestOutput.outputs`` is one ``CompletionOutput`` (``out.outputs.text``);
    with ``n > 1`` a request has several, so this is a list of them (``out.outputs[i]``) that
    also answers ``out.outputs.text`` / ``.token_ids`` / ``.logprobs`` / ``.finish_reason`` from
    the first choice, so code written for FastDeploy works unchanged.
    """

    def __getattr__(self, name: str):
        if name.startswith("__") or not self:
            raise AttributeError(name)
        return getattr(self[0], name)


@dataclass
class RequestOutput:
    """A request's result so far (``finished`` once every choice ended).

    ``outputs`` is a :class:`CompletionOutputs`: ``out.outputs.text`` (FastDeploy style, choice 0)
    and ``out.outputs[i].text`` (every choice) both work.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: CompletionOutputs
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None


def choice_request_id(request_id: str, index: int, n: int) -> str:
    """The engine core's id for choice ``index`` of a request with ``n`` choices.

    A single-choice request keeps its own id; choices of ``n > 1`` become ``"{id}#{index}"``.
    ``EngineCore.abort_requests`` accepts either form (a request id aborts every choice).
    """
    return request_id if n == 1 else f"{request_id}#{index}"
