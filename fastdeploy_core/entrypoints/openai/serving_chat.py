"""POST /v1/chat/completions: chat template and tokenization here, generation in the engine core."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from fastdeploy_core.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaMessage,
)
from fastdeploy_core.entrypoints.openai.serving_engine import (
    SSE_DONE,
    LeasedStreamingResponse,
    ServingState,
    guarded_stream,
    sse,
    sse_error,
    usage_for,
)
from fastdeploy_core.errors import InvalidRequestError


def render_chat_prompt(state: ServingState, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    """The prompt text and its token ids (chat template applied unless disabled).

    Slow for long conversations: call it through :meth:`ServingState.off_loop`.
    """
    state.check_chat_template(req.chat_template)
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in req.messages]
    if req.disable_chat_template:
        text = "".join(m["content"] for m in messages)
        return text, state.encode_prompt(text, add_special_tokens=True, param="messages")
    kwargs = dict(req.chat_template_kwargs or {})
    template = req.chat_template or state.chat_template
    try:
        text = state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, chat_template=template,
            max_chars=state.max_prompt_chars, **kwargs
        )
    except InvalidRequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - a user template or kwargs that the template rejects
        raise InvalidRequestError(f"chat template failed: {type(exc).__name__}: {exc}", param="messages") from None
    # The template writes the special tokens itself; do not add a second bos.
    return text, state.encode_prompt(text, add_special_tokens=False, param="messages")


def _prepare(state: ServingState, req: ChatCompletionRequest):
    prompt, prompt_ids = render_chat_prompt(state, req)
    params = state.sampling_params(req, max_tokens=req.requested_max_tokens(), logprobs=req.num_logprobs())
    state.check_length(prompt_ids, params)
    return prompt, prompt_ids, params


async def create_chat_completion(state: ServingState, req: ChatCompletionRequest, raw: Request) -> Any:
    """Validate, admit and run one chat request; a JSON body or an SSE stream."""
    arrival = time.time()
    state.check_engine()
    state.check_model(req.model)
    state.check_priority(req.priority)
    prompt, prompt_ids, params = await state.off_loop(_prepare, state, req)
    top_n = req.top_logprobs or 0
    request_id = state.new_request_id("chatcmpl", req.request_id)
    lease = await state.admission.admit(req.n)
    state.metrics.requests_number.inc()
    model = state.served_model_name
    jobs = [(request_id, prompt, prompt_ids, params)]

    if req.stream:
        gen = _stream(state, req, raw, jobs, arrival, lease.admitted, model, top_n)
        return LeasedStreamingResponse(guarded_stream(gen, sse_error), lease)

    try:
        final = None
        async for _, out in state.stream_outputs(raw, jobs, arrival, priority=req.priority):
            final = out
    finally:
        lease.release()
    state.record(final, arrival, lease.admitted, success=True)
    choices = []
    completion_tokens = 0
    for c in sorted(final.outputs, key=lambda c: c.index):
        completion_tokens += len(c.token_ids)
        choices.append(
            ChatCompletionChoice(
                index=c.index,
                message=ChatMessage(
                    content=c.text,
                    prompt_token_ids=list(final.prompt_token_ids) if req.return_token_ids else None,
                    completion_token_ids=list(c.token_ids) if req.return_token_ids else None,
                ),
                logprobs=ChatLogprobs(content=state.chat_logprobs(c.token_ids, c.logprobs, top_n))
                if req.logprobs
                else None,
                finish_reason=_finish_reason(c.finish_reason),
            )
        )
    return ChatCompletionResponse(
        id=request_id,
        model=model,
        choices=choices,
        usage=usage_for(len(prompt_ids), completion_tokens, final.num_cached_tokens),
    )


def _finish_reason(reason: str | None) -> str | None:
    # The engine says "abort" for a stop string cut short in the API process only if it raced;
    # OpenAI clients know stop/length.
    return "stop" if reason == "abort" else reason


async def _stream(
    state: ServingState,
    req: ChatCompletionRequest,
    raw: Request,
    jobs: list,
    arrival: float,
    admitted: float,
    model: str,
    top_n: int,
) -> AsyncIterator[str]:
    request_id, _, prompt_ids, _ = jobs[0]
    created = int(arrival)
    include_usage = req.include_usage_in_stream()
    continuous_usage = req.usage_in_every_chunk()
    final = None

    def chunk(choices: list[ChatCompletionStreamChoice]) -> str:
        usage = None
        if continuous_usage:  # the usage so far, in every chunk
            completion_tokens = sum(len(c.token_ids) for c in final.outputs) if final is not None else 0
            usage = usage_for(len(prompt_ids), completion_tokens, final.num_cached_tokens if final is not None else 0)
        return sse(
            ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)
        )

    for i in range(req.n):
        yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])

    sent_ids = False
    done: set[int] = set()
    async for _, out in state.stream_outputs(raw, jobs, arrival, priority=req.priority):
        final = out
        choices = []
        for c in out.outputs:
            if c.index in done or not (c.delta_text or c.delta_token_ids or c.finish_reason):
                continue
            if c.finish_reason:
                done.add(c.index)
            delta = DeltaMessage(content=c.delta_text)
            if req.return_token_ids:
                delta.completion_token_ids = list(c.delta_token_ids)
                if not sent_ids:
                    delta.prompt_token_ids = list(prompt_ids)
            choices.append(
                ChatCompletionStreamChoice(
                    index=c.index,
                    delta=delta,
                    logprobs=ChatLogprobs(content=state.chat_logprobs(c.delta_token_ids, c.delta_logprobs, top_n))
                    if req.logprobs
                    else None,
                    finish_reason=_finish_reason(c.finish_reason),
                )
            )
        if choices:
            sent_ids = True
            yield chunk(choices)
    if final is not None:
        state.record(final, arrival, admitted, success=True)
        if include_usage:
            completion_tokens = sum(len(c.token_ids) for c in final.outputs)
            yield sse(
                ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=usage_for(len(prompt_ids), completion_tokens, final.num_cached_tokens),
                )
            )
    yield SSE_DONE
