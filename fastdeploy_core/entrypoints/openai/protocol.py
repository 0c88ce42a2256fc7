"""Pydantic models of the OpenAI-compatible HTTP API (requests, responses, errors).

Request models take OpenAI's fields plus FastDeploy's extras (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``bad_words``,
``include_stop_str_in_output``, ``chat_template_kwargs``, ``return_token_ids``,
``disable_chat_template``, ``request_id``). Unknown fields are accepted, ignored and logged
once per field name. Shapes are checked here; sampling ranges are checked once more by
:class:`~fastdeploy_core.engine.sampling_params.SamplingParams`, which names the parameter.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fastdeploy_core.errors import InvalidRequestError
from fastdeploy_core.guided.params import GuidedDecodingParams

logger = logging.getLogger("fastdeploy.serve")

#: Limits that keep one request from costing the server more than it can serve.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_N = 16
MAX_TOP_LOGPROBS = 20

_warned_unknown_fields: set[str] = set()
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,12}")  # ASCII digits: str.isdigit() also takes "²", which int() refuses


class OpenAIBaseModel(BaseModel):
    """Base of request models: accepts unknown fields and logs each new name once."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> OpenAIBaseModel:
        extra = self.model_extra or {}
        new = sorted(k for k in extra if k not in _warned_unknown_fields)
        if new:
            _warned_unknown_fields.update(new)
            # ascii(): a field name may hold text the log stream cannot encode
            logger.warning("%s: ignoring unknown field(s) %s", type(self).__name__, ascii(new)[1:-1])
        return self


class _ResponseModel(BaseModel):
    model_config = ConfigDict(protected_namespaces=())


# --- errors ---------------------------------------------------------------------------------


class ErrorInfo(_ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_ResponseModel):
    error: ErrorInfo


# --- shared request pieces ------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(OpenAIBaseModel):
    """``response_format.json_schema``: the schema is enforced whether or not ``strict`` is set."""

    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise InvalidRequestError(
                'response_format: type "json_schema" needs json_schema.schema (the JSON schema of the reply)',
                param="response_format",
            )
        return self


class _SamplingFields(OpenAIBaseModel):
    """Fields common to chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # FastDeploy extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    return_token_ids: bool = False
    request_id: str | None = Field(None, min_length=1, max_length=256)
    # vLLM / FastDeploy extra: lower runs first when the server was started with --policy priority
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    # vLLM / FastDeploy structured-output extras (one constraint per request, response_format included)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    @model_validator(mode="after")
    def _check_common(self) -> _SamplingFields:
        stops = self.stop_list()
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                f"stop: {len(stops)} stop strings given; at most {MAX_STOP_STRINGS} are allowed",
                param="stop",
            )
        for s in stops:
            if not s:
                raise InvalidRequestError("stop: empty stop strings are not allowed", param="stop")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    f"stop: a stop string has {len(s)} characters; at most {MAX_STOP_STRING_CHARS} are allowed",
                    param="stop",
                )
        self.guided_params()  # one constraint at most, of the right shape
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        if self.logit_bias:
            for key, value in self.logit_bias.items():
                if not _TOKEN_ID_KEY.fullmatch(key):
                    raise InvalidRequestError(
                        f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias"
                    )
                if not -100.0 <= value <= 100.0:
                    raise InvalidRequestError(
                        f"logit_bias: bias {value} for token {key} is outside [-100, 100]", param="logit_bias"
                    )
        return self

    def guided_params(self) -> GuidedDecodingParams | None:
        """The output constraint the request asks for (``response_format`` or a ``guided_*``
        extra), or None; two at once is a 400."""
        given: dict[str, Any] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given["json_object"] = True
        elif fmt is not None and fmt.type == "json_schema":
            given["json"] = fmt.json_schema.schema_  # type: ignore[union-attr]
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar"), ("structural_tag", "structural_tag")):
            value = getattr(self, name)
            if value is not None:
                if key in given:
                    raise InvalidRequestError(f"{name}: response_format already constrains the reply", param=name)
                given[key] = value
        if not given:
            return None
        if len(given) > 1:
            raise InvalidRequestError(
                f"give one output constraint per request; got {', '.join(sorted(given))}", param="response_format"
            )
        return GuidedDecodingParams(**given)

    def stop_list(self) -> list[str]:
        """``stop`` as a list (OpenAI allows one string or a list)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def usage_in_every_chunk(self) -> bool:
        """``stream_options.continuous_usage_stats``: each content chunk carries the usage so far."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


# --- chat -----------------------------------------------------------------------------------


class ChatMessageParam(OpenAIBaseModel):
    """One message of ``messages``; ``content`` is a string or OpenAI's list of text parts."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    #: An assistant turn's calls, as OpenAI returned them (handed to the chat template as given).
    tool_calls: list[dict[str, Any]] | None = None
    #: A ``tool`` turn: the call this result answers.
    tool_call_id: str | None = None
    #: An assistant turn's reasoning as a reasoning parser returned it (templates that keep or
    #: drop past reasoning read it).
    reasoning_content: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        return out

    def text(self) -> str:
        """The text of the message; non-text parts are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for part in self.content:
            kind = part.get("type")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"messages: content part of type {kind!r} is not supported; only text parts are",
                    param="messages",
                )
            pieces.append(part["text"])
        return "".join(pieces)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageParam] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    disable_chat_template: bool = False

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        for tool in self.tools or []:
            fn = tool.get("function") if isinstance(tool, dict) else None
            if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidRequestError(
                    'tools: each tool is {"type": "function", "function": {"name": ..., "parameters": {...}}}',
                    param="tools",
                )
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise InvalidRequestError("tools: function.parameters must be a JSON schema object", param="tools")
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f'tool_choice: got {choice!r}; use "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if choice not in (None, "none", "auto"):
            if not self.tools:
                raise InvalidRequestError("tool_choice: a tool must be chosen from tools, and none were given",
                                          param="tool_choice")
            if self.guided_params() is not None:
                raise InvalidRequestError("tool_choice: a forced tool call already constrains the reply; drop "
                                          "response_format / guided_*", param="tool_choice")
            name = self.named_tool()
            if isinstance(choice, dict) and name not in {t["function"]["name"] for t in self.tools}:
                raise InvalidRequestError(f"tool_choice: function {name!r} is not among tools", param="tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        return self

    def named_tool(self) -> str | None:
        """The function a ``{"type": "function", "function": {"name": ...}}`` tool_choice names."""
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return None
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(
                'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}', param="tool_choice"
            )
        return fn["name"]

    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        """How many logprobs per token the engine should return (None = none)."""
        return (self.top_logprobs or 0) if self.logprobs else None


# --- completions ----------------------------------------------------------------------------


class CompletionRequest(_SamplingFields):
    """POST /v1/completions; ``prompt`` is a string, strings, token ids or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise InvalidRequestError("suffix is not supported yet", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of other than n is not supported yet", param="best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise InvalidRequestError("prompt: an empty list is not a prompt", param="prompt")
        if isinstance(self.prompt, list) and any(isinstance(p, list) and not p for p in self.prompt):
            raise InvalidRequestError("prompt: an empty token list is not a prompt", param="prompt")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the batch, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# --- responses ------------------------------------------------------------------------------


class PromptTokensDetails(_ResponseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(_ResponseModel):
    #: Tokens of the reply's reasoning section (with --reasoning-parser), tags included.
    reasoning_tokens: int = 0


class UsageInfo(_ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(_ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_ResponseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_ResponseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCall(_ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(_ResponseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class ChatMessage(_ResponseModel):
    role: str = "assistant"
    content: str | None = None
    #: The reply's reasoning section (with --reasoning-parser; vLLM's field name).
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None


class ChatCompletionChoice(_ResponseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ChatCompletionResponse(_ResponseModel):
    id: str = Field(default_factory=lambda: _new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(_ResponseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None


class ChatCompletionStreamChoice(_ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(_ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(_ResponseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None


class CompletionResponse(_ResponseModel):
    id: str = Field(default_factory=lambda: _new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(_ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# --- models, tokenize, abort ----------------------------------------------------------------


class ModelCard(_ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "fastdeploy"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: either ``prompt`` or chat ``messages`` (then the chat template applies)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
        return self


class TokenizeResponse(_ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_ResponseModel):
    prompt: str


class AbortRequest(OpenAIBaseModel):
    """POST /v1/abort_requests: the ids given as ``request_id`` (or returned as ``id``)."""

    req_ids: list[str] = Field(default_factory=list)
    abort_all: bool = False


class AbortResponse(_ResponseModel):
    aborted: list[str]
    not_found: list[str]
