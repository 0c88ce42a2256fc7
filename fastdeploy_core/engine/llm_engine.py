"""The in-process engine: :class:`EngineCore` + tokenizer + :class:`OutputProcessor`.

``LLM`` and the ``generate`` / ``chat`` / ``bench`` commands use it; the server splits the same
parts over two processes (core in the engine process, tokenizer and processor in the API one).
"""

from __future__ import annotations

import itertools
import time

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.engine.engine_core import EngineCore, validate_prompt
from fastdeploy_core.engine.output_processor import OutputProcessor
from fastdeploy_core.engine.outputs import EngineCoreRequest, RequestOutput
from fastdeploy_core.engine.sampling_params import SamplingParams


class LLMEngine:
    """Add requests, call :meth:`step` until done, read :class:`RequestOutput` objects."""

    def __init__(self, args: EngineArgs, plugin_manager=None):
        from fastdeploy_core.tokenizer import load_tokenizer

        self.args = args
        self.core = EngineCore(args, plugin_manager)
        self.tokenizer = load_tokenizer(self.core.model_source)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, **kwargs) -> LLMEngine:
        """Build from flat engine arguments (``model=..., max_num_seqs=...``)."""
        return cls(EngineArgs.create(**kwargs))

    @property
    def generation_config(self) -> dict:
        return self.core.model_source.generation_config

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams().with_generation_config_defaults(self.generation_config)

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        """Tokenize (if text), validate and queue; returns the request id."""
        request_id = request_id if request_id is not None else self.new_request_id()
        arrival_time = arrival_time if arrival_time is not None else time.time()
        # a copy: the engine fills fields in (defaults, bad-word ids); the caller's object stays as given
        params = SamplingParams.from_dict((sampling_params or SamplingParams()).to_dict())
        params = params.with_generation_config_defaults(self.generation_config)
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        else:
            text, token_ids = None, [int(t) for t in prompt]
        validate_prompt(token_ids, params, self.core.max_model_len, self.core.vocab_size)
        if params.guided_decoding is not None and self.core.guided is not None:
            self.core.guided.check(params.guided_decoding)  # a bad schema fails here, with its message
        self.processor.add_request(request_id, text, token_ids, params, arrival_time)
        try:
            self.core.add_request(EngineCoreRequest(request_id, token_ids, params, arrival_time, priority))
        except Exception:
            self.processor.abort_request(request_id)
            raise
        return request_id

    def abort_request(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)
        for rid in request_ids:
            self.processor.abort_request(rid)

    def step(self) -> list[RequestOutput]:
        """One engine step; the RequestOutputs of every request it touched."""
        processed = self.processor.process_outputs(self.core.step())
        if processed.reqs_to_abort:
            self.core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_stats(self) -> dict:
        return self.core.get_stats()
