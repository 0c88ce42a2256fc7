"""The offline API: ``from fastdeploy_core import LLM, SamplingParams``.

::

    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    llm = LLM(model="path/to/hf-dir-or.gguf", max_num_seqs=16, kv_cache_memory="1GiB")
    outs = llm.generate(["Hello", "The sky is"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}])

Engine arguments are FastDeploy's flag names with ``_`` (see :class:`~fastdeploy_core.config.EngineArgs`).
Outputs are :class:`~fastdeploy_core.engine.outputs.RequestOutput`, in the order of the prompts.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Sequence
from typing import Any, Self

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.engine.llm_engine import LLMEngine
from fastdeploy_core.engine.outputs import RequestOutput
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.errors import ConfigError, EngineDeadError, InvalidRequestError

PromptType = str | list[int] | dict

logger = logging.getLogger("fastdeploy")


def _check_offline_scheduler(args: EngineArgs) -> None:
    """The offline engine runs in this process with no request-level scheduler in front of it:
    a ``scheduler_name`` other than ``local`` is refused (it would be accepted and do nothing),
    and scheduler settings given anyway are named in a warning."""
    sched = args.scheduler
    if sched.scheduler_name != "local":
        raise ConfigError(
            f"scheduler_name: the offline LLM runs one in-process engine with no request-level scheduler, so "
            f"{sched.scheduler_name!r} would do nothing here; it schedules requests of `fastdeploy serve` "
            f"instances (`fastdeploy serve --scheduler-name {sched.scheduler_name}`); drop scheduler_name for "
            "offline use",
            param="scheduler_name",
        )
    given = [
        key for key, info in type(sched).model_fields.items()
        if key.startswith("scheduler_") and getattr(sched, key) != info.default
    ]
    if given:
        logger.warning("the offline LLM has no request-level scheduler; %s apply to `fastdeploy serve` only",
                       ", ".join(given))


class LLM:
    """An in-process engine with a batch ``generate`` and a ``chat`` helper.

    ``close()`` (or ``with LLM() as llm:``) frees the model, its KV cache and captured decode
    steps at once; without it they go when the object is collected, or at interpreter exit.
    """

    def __init__(self, model: str | None = None, **engine_args: Any):
        self.engine_args = EngineArgs.create(model=model, **engine_args)
        _check_offline_scheduler(self.engine_args)
        self.engine = LLMEngine(self.engine_args)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        """Build from an already validated :class:`EngineArgs` (the CLI's path)."""
        _check_offline_scheduler(args)
        llm = cls.__new__(cls)
        llm.engine_args = args
        llm.engine = LLMEngine(args)
        return llm

    @property
    def engine(self) -> LLMEngine:
        """The in-process engine; a closed LLM says so instead of failing somewhere inside."""
        engine = self.__dict__.get("_engine")
        if engine is None:
            raise EngineDeadError("this LLM was closed; create a new LLM(...) to generate again")
        return engine

    @engine.setter
    def engine(self, value: LLMEngine) -> None:
        self._engine = value

    def close(self) -> None:
        """Free the engine's memory now: captured decode steps, KV cache, weights. Idempotent."""
        engine = self.__dict__.pop("_engine", None)
        if engine is not None:
            engine.core.runner.close()
            if engine.core.proposer is not None:
                engine.core.proposer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """Built-in defaults overlaid with the model's generation_config.json."""
        return self.engine.default_sampling_params()

    # ---- generate --------------------------------------------------------------------------
    @staticmethod
    def _normalize_prompts(prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if hasattr(prompts, "tolist") and not isinstance(prompts, list):  # numpy / paddle arrays of ids
            prompts = prompts.tolist()
        if (
            isinstance(prompts, Sequence)
            and prompts
            and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompts)
        ):
            return [[int(t) for t in prompts]]  # one prompt of token ids
        if isinstance(prompts, Sequence):
            return list(prompts)
        raise InvalidRequestError(
            "prompts must be a string, a list of strings, a list of token ids or a list of lists of token ids",
            param="prompts",
        )

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]] | dict | list[dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs are in prompt order.

        A prompt is text, a list of token ids, or a dict with ``prompt`` or ``prompt_token_ids``.
        ``sampling_params`` is one object for all prompts or one per prompt.
        """
        items = self._normalize_prompts(prompts)
        if not items:
            return []
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(items):
                raise InvalidRequestError(
                    f"got {len(sampling_params)} sampling_params for {len(items)} prompts; pass one or one per prompt",
                    param="sampling_params",
                )
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params] * len(items)
        request_ids = []
        try:
            for i, (item, params) in enumerate(zip(items, params_list)):
                prompt: str | list[int]
                if isinstance(item, dict):
                    prompt = item.get("prompt_token_ids") or item.get("prompt") or ""
                else:
                    prompt = item.tolist() if hasattr(item, "tolist") else item
                if not isinstance(prompt, (str, list)):
                    raise InvalidRequestError(
                        f"prompt {i} is a {type(prompt).__name__}; use a string or a list of token ids", param="prompts"
                    )
                prio = priority[i] if priority is not None else 0
                request_ids.append(self.engine.add_request(prompt, params, priority=prio))
        except Exception:
            self.engine.abort_request(request_ids)  # queued so far: free them, then report
            raise
        return self._run(request_ids, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[r] for r in request_ids]

    # ---- chat ------------------------------------------------------------------------------
    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template, then generate (one output each)."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {role, content} dicts", param="messages")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        template = chat_template or self.engine_args.model.chat_template
        prompts = [
            self.tokenizer.apply_chat_template(
                conv,
                add_generation_prompt=add_generation_prompt,
                chat_template=template,
                **(chat_template_kwargs or {}),
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
