"""POST /v1/completions: prompt as str, [str], [int] or [[int]]; ``echo``, ``n``, ``logprobs``.

A batch of prompts becomes one engine request per prompt, run concurrently; choice ``i`` of
prompt ``k`` has index ``k * n + i`` (OpenAI's order).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from fastdeploy_core.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
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


def _prepare_prompts(state: ServingState, req: CompletionRequest) -> list[tuple[str, list[int]]]:
    prompts = []
    for p in req.prompts():
        if isinstance(p, str):
            prompts.append((p, state.encode_prompt(p, add_special_tokens=True)))
        else:
            ids = list(p)
            state.check_token_ids(ids, "prompt")  # before decode: the tokenizer takes only valid ids
            prompts.append((state.tokenizer.decode(ids, skip_special_tokens=False), ids))
    return prompts


def _prepare(state: ServingState, req: CompletionRequest):
    prompts = _prepare_prompts(state, req)
    params = state.sampling_params(
        req,
        max_tokens=req.max_tokens if req.max_tokens is not None else 16,  # OpenAI's default for completions
        logprobs=req.logprobs,
        prompt_logprobs=req.logprobs if (req.echo and req.logprobs is not None) else None,
    )
    for _, ids in prompts:
        state.check_length(ids, params)
    return prompts, params


async def create_completion(state: ServingState, req: CompletionRequest, raw: Request) -> Any:
    """Validate, admit and run a completion request (one or many prompts)."""
    arrival = time.time()
    state.check_engine()
    state.check_model(req.model)
    state.check_priority(req.priority)
    prompts, params = await state.off_loop(_prepare, state, req)
    top_n = req.logprobs or 0
    base_id = state.new_request_id("cmpl", req.request_id)
    jobs = [
        (base_id if len(prompts) == 1 else f"{base_id}-{k}", text, ids, params)
        for k, (text, ids) in enumerate(prompts)
    ]
    lease = await state.admission.admit(req.n * len(prompts))
    state.metrics.requests_number.inc()  # after admission: a 429 is not a request received
    model = state.served_model_name

    if req.stream:
        gen = _stream(state, req, raw, jobs, arrival, lease.admitted, model, base_id, top_n)
        return LeasedStreamingResponse(guarded_stream(gen, sse_error), lease)

    finals: dict[int, Any] = {}
    try:
        async for k, out in state.stream_outputs(raw, jobs, arrival, priority=req.priority):
            finals[k] = out
    finally:
        lease.release()
    choices = []
    prompt_tokens = completion_tokens = cached = 0
    for k, (_, text, ids, _) in enumerate(jobs):
        out = finals[k]
        state.record(out, arrival, lease.admitted, success=True)
        prompt_tokens += len(ids)
        cached += out.num_cached_tokens
        for c in sorted(out.outputs, key=lambda c: c.index):
            completion_tokens += len(c.token_ids)
            logprobs = None
            if req.logprobs is not None:
                tokens, lps = list(c.token_ids), list(c.logprobs or [])
                if req.echo:
                    tokens = list(ids) + tokens
                    lps = list(out.prompt_logprobs or [None] * len(ids)) + lps
                logprobs = state.completion_logprobs(tokens, lps, top_n, 0)
            choices.append(
                CompletionChoice(
                    index=k * req.n + c.index,
                    text=(text if req.echo else "") + c.text,
                    logprobs=logprobs,
                    finish_reason="stop" if c.finish_reason == "abort" else c.finish_reason,
                    prompt_token_ids=list(ids) if req.return_token_ids else None,
                    completion_token_ids=list(c.token_ids) if req.return_token_ids else None,
                )
            )
    return CompletionResponse(
        id=base_id,
        model=model,
        choices=choices,
        usage=usage_for(prompt_tokens, completion_tokens, cached),
    )


async def _stream(
    state: ServingState,
    req: CompletionRequest,
    raw: Request,
    jobs: list,
    arrival: float,
    admitted: float,
    model: str,
    base_id: str,
    top_n: int,
) -> AsyncIterator[str]:
    created = int(arrival)
    finals: dict[int, Any] = {}

    def usage_so_far():
        prompt_tokens = sum(len(j[2]) for j in jobs)
        completion_tokens = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
        cached = sum(out.num_cached_tokens for out in finals.values())
        return usage_for(prompt_tokens, completion_tokens, cached)

    def chunk(choices: list[CompletionChoice], usage=None) -> str:
        if usage is None and req.usage_in_every_chunk():
            usage = usage_so_far()
        return sse(CompletionStreamResponse(id=base_id, created=created, model=model, choices=choices, usage=usage))

    offsets: dict[int, int] = {}
    if req.echo:
        for k, job in enumerate(jobs):
            for i in range(req.n):
                offsets[k * req.n + i] = len(job[1])
                yield chunk([CompletionChoice(index=k * req.n + i, text=job[1])])

    done: set[int] = set()
    async for k, out in state.stream_outputs(raw, jobs, arrival, priority=req.priority):
        finals[k] = out
        choices = []
        for c in out.outputs:
            index = k * req.n + c.index
            if index in done or not (c.delta_text or c.delta_token_ids or c.finish_reason):
                continue
            if c.finish_reason:
                done.add(index)
            logprobs = None
            if req.logprobs is not None:
                logprobs = state.completion_logprobs(
                    list(c.delta_token_ids), list(c.delta_logprobs or []), top_n, offsets.get(index, 0)
                )
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs.tokens)
            choices.append(
                CompletionChoice(
                    index=index,
                    text=c.delta_text,
                    logprobs=logprobs,
                    finish_reason="stop" if c.finish_reason == "abort" else c.finish_reason,
                    prompt_token_ids=list(jobs[k][2]) if req.return_token_ids and c.finish_reason else None,
                    completion_token_ids=list(c.delta_token_ids) if req.return_token_ids else None,
                )
            )
        if choices:
            yield chunk(choices)
    for out in finals.values():
        state.record(out, arrival, admitted, success=True)
    if req.include_usage_in_stream():
        yield chunk([], usage=usage_so_far())
    yield SSE_DONE
