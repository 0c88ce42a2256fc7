"""POST /v1/chat/completions: chat template and tokenization here, generation in the engine core."""

from __future__ import annotations

import time
import uuid
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
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from fastdeploy_core.entrypoints.openai.reasoning_parsers import ReasoningParser, reasoning_token_count
from fastdeploy_core.entrypoints.openai.serving_engine import (
    SSE_DONE,
    LeasedStreamingResponse,
    ServingState,
    guarded_stream,
    sse,
    sse_error,
    usage_for,
)
from fastdeploy_core.entrypoints.openai.tool_parsers import (
    ParsedToolCall,
    calls_from_constrained,
    named_schema,
    required_schema,
)
from fastdeploy_core.errors import InvalidRequestError
from fastdeploy_core.guided.params import GuidedDecodingParams


def render_chat_prompt(state: ServingState, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    """The prompt text and its token ids (chat template applied unless disabled).

    Slow for long conversations: call it through :meth:`ServingState.off_loop`.
    """
    state.check_chat_template(req.chat_template)
    messages = [m.template_dict() for m in req.messages]
    if req.disable_chat_template:
        text = "".join(m["content"] for m in messages)
        return text, state.encode_prompt(text, add_special_tokens=True, param="messages")
    kwargs = dict(req.chat_template_kwargs or {})
    if req.uses_tools():
        kwargs.setdefault("tools", req.tools)  # templates that know tools describe them to the model
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


def tool_mode(state: ServingState, req: ChatCompletionRequest) -> str | None:
    """How the reply's tool calls are found: "named" / "required" (constrained JSON), "auto"
    (the --tool-call-parser reads the model's own format), or None (plain text)."""
    if not req.uses_tools():
        return None
    if req.named_tool() is not None:
        return "named"
    if req.tool_choice == "required":
        return "required"
    return "auto" if state.tool_parser is not None else None


#: Constraints whose reply is JSON from its first token: no room for a reasoning section, so
#: their replies are never split (with deepseek_r1 they would all count as reasoning).
_JSON_KINDS = ("json", "json_object")


def reasoning_parser_for(state: ServingState, req: ChatCompletionRequest, mode: str | None) -> ReasoningParser | None:
    """A fresh ``--reasoning-parser`` for one choice, or None when the reply is not split: no
    parser chosen, a forced tool call, or a JSON constraint. Other constraints (regex, choice,
    grammar) cover the whole reply, reasoning included, and their replies are split."""
    if state.reasoning_parser is None or mode in ("named", "required"):
        return None
    guided = req.guided_params()
    if guided is not None and guided.kind in _JSON_KINDS:
        return None
    return state.reasoning_parser(state.tokenizer)


def _reasoning_tokens(state: ServingState, req: ChatCompletionRequest, mode: str | None, outputs) -> int | None:
    """Usage's reasoning_tokens over every choice (None without a reasoning parser)."""
    if state.reasoning_parser is None:
        return None
    total = 0
    for c in outputs:
        parser = reasoning_parser_for(state, req, mode)
        if parser is not None:
            split = parser.partition(c.text, finished=True)
            total += reasoning_token_count(list(c.token_ids), split.reasoning_chars, state.tokenizer.decode)
    return total


def _tool_constraint(req: ChatCompletionRequest, mode: str | None) -> GuidedDecodingParams | None:
    if mode == "named":
        name = req.named_tool()
        tool = next(t for t in req.tools or [] if t["function"]["name"] == name)
        return GuidedDecodingParams(json=named_schema(tool))
    if mode == "required":
        return GuidedDecodingParams(json=required_schema(req.tools or [], req.parallel_tool_calls))
    return None


def _prepare(state: ServingState, req: ChatCompletionRequest):
    prompt, prompt_ids = render_chat_prompt(state, req)
    guided = _tool_constraint(req, tool_mode(state, req))
    params = state.sampling_params(req, max_tokens=req.requested_max_tokens(), logprobs=req.num_logprobs(),
                                   guided=guided)
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
    mode = tool_mode(state, req)
    for c in sorted(final.outputs, key=lambda c: c.index):
        completion_tokens += len(c.token_ids)
        text, reasoning = c.text, None
        parser = reasoning_parser_for(state, req, mode)
        if parser is not None:
            split = parser.partition(text, finished=True)
            text, reasoning = split.content, split.reasoning or None
        content, calls, finish = _reply(state, req, mode, text, _finish_reason(c.finish_reason))
        choices.append(
            ChatCompletionChoice(
                index=c.index,
                message=ChatMessage(
                    content=content if parser is None else content or None,
                    reasoning_content=reasoning,
                    tool_calls=[ToolCall(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments))
                                for t in calls] or None,
                    prompt_token_ids=list(final.prompt_token_ids) if req.return_token_ids else None,
                    completion_token_ids=list(c.token_ids) if req.return_token_ids else None,
                ),
                logprobs=ChatLogprobs(content=state.chat_logprobs(c.token_ids, c.logprobs, top_n))
                if req.logprobs
                else None,
                finish_reason=finish,
            )
        )
    return ChatCompletionResponse(
        id=request_id,
        model=model,
        choices=choices,
        usage=usage_for(len(prompt_ids), completion_tokens, final.num_cached_tokens,
                        _reasoning_tokens(state, req, mode, final.outputs)),
    )


def _reply(state: ServingState, req: ChatCompletionRequest, mode: str | None, text: str,
           finish: str | None) -> tuple[str | None, list[ParsedToolCall], str | None]:
    """(content, tool calls, finish_reason) of a finished choice."""
    if mode in ("named", "required"):
        calls = calls_from_constrained(text, req.named_tool()) if finish == "stop" else None
        if calls:
            return None, calls, "tool_calls"
        return text, [], finish  # cut by max_tokens: the partial JSON as text, finish_reason "length"
    if mode == "auto":
        parsed = state.tool_parser(state.tokenizer).parse(text)
        if parsed.tool_calls:
            return parsed.content, parsed.tool_calls, "tool_calls"
    return text, [], finish


class _ChoiceStream:
    """Turns one choice's text deltas into OpenAI stream deltas (reasoning, content or tool calls).

    With a reasoning parser the raw text is split first; the content part then goes through the
    tool-call logic as if it were the whole reply."""

    def __init__(self, state: ServingState, req: ChatCompletionRequest, mode: str | None):
        self.state, self.req, self.mode = state, req, mode
        self.text = ""
        self.sent = 0  # characters of text already sent (as content or as arguments)
        self.call_id = f"call_{uuid.uuid4().hex[:24]}"
        self.parser = state.tool_parser(state.tokenizer) if mode == "auto" else None
        self.reasoning = reasoning_parser_for(state, req, mode)
        self.raw = ""  # the reply so far, reasoning included (with a reasoning parser)
        self.reasoning_sent = 0

    def delta(self, new_text: str, finish: str | None) -> tuple[DeltaMessage | None, str | None]:
        if self.reasoning is None:
            return self._content_delta(new_text, finish)
        self.raw += new_text
        split = self.reasoning.partition(self.raw, finished=finish is not None)
        thought, self.reasoning_sent = split.reasoning[self.reasoning_sent :], len(split.reasoning)
        content_new = split.content[len(self.text) :]
        delta, reason = self._content_delta(content_new, finish)
        if thought:
            delta = delta or DeltaMessage()
            delta.reasoning_content = thought
            if delta.content == "":
                delta.content = None  # a reasoning chunk carries no empty content beside it
        return delta, reason

    def _content_delta(self, new_text: str, finish: str | None) -> tuple[DeltaMessage | None, str | None]:
        self.text += new_text
        if self.mode == "named":
            return self._named(finish)
        if self.mode is None or (finish is None and self.mode == "required"):
            if self.mode is None:
                return (DeltaMessage(content=new_text) if new_text or finish else None), finish
            return None, None
        if finish is None:  # auto: send what is surely content
            end = self.parser.content_end(self.text)
            if end <= self.sent:
                return None, None
            piece, self.sent = self.text[self.sent : end], end
            return DeltaMessage(content=piece), None
        _, calls, reason = _reply(self.state, self.req, self.mode, self.text, finish)
        if not calls:
            rest, self.sent = self.text[self.sent :], len(self.text)
            return DeltaMessage(content=rest), reason
        return DeltaMessage(tool_calls=[
            DeltaToolCall(index=i, id=t.id, type="function", function=FunctionCall(name=t.name, arguments=t.arguments))
            for i, t in enumerate(calls)
        ]), reason

    def _named(self, finish: str | None) -> tuple[DeltaMessage | None, str | None]:
        calls: list[DeltaToolCall] = []
        if self.sent == 0 and self.text:
            calls.append(DeltaToolCall(index=0, id=self.call_id, type="function",
                                       function=FunctionCall(name=self.req.named_tool(), arguments="")))
        if len(self.text) > self.sent:
            calls.append(DeltaToolCall(index=0, function=FunctionCall(arguments=self.text[self.sent :])))
            self.sent = len(self.text)
        reason = finish
        if finish == "stop" and calls_from_constrained(self.text, self.req.named_tool()):
            reason = "tool_calls"
        return (DeltaMessage(tool_calls=calls) if calls else (DeltaMessage() if finish else None)), reason


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
    mode = tool_mode(state, req)
    streams: dict[int, _ChoiceStream] = {}
    async for _, out in state.stream_outputs(raw, jobs, arrival, priority=req.priority):
        final = out
        choices = []
        for c in out.outputs:
            if c.index in done or not (c.delta_text or c.delta_token_ids or c.finish_reason):
                continue
            if c.finish_reason:
                done.add(c.index)
            stream = streams.setdefault(c.index, _ChoiceStream(state, req, mode))
            delta, finish = stream.delta(c.delta_text, _finish_reason(c.finish_reason))
            if delta is None:
                if not (req.return_token_ids or req.logprobs):
                    continue
                delta = DeltaMessage()
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
                    finish_reason=finish,
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
                    usage=usage_for(len(prompt_ids), completion_tokens, final.num_cached_tokens,
                                    _reasoning_tokens(state, req, mode, final.outputs)),
                )
            )
    yield SSE_DONE
