"""Tool calls in a model's reply: the parser contract, the built-in parsers, and the constraints
that make ``tool_choice`` ``required`` / a named function hold.

``tool_choice: "auto"`` lets the model choose: a :class:`ToolParser` (``--tool-call-parser``,
registered through ``register_tool_parsers``) finds the calls in the text the model wrote in its
own format. ``"required"`` and a named function do not trust the model's format: the reply is
constrained by guided decoding to JSON (:func:`required_schema`: an array of
``{"name", "parameters"}``; :func:`named_schema`: the function's arguments) and read back by
:func:`calls_from_constrained`, so the arguments always parse against the function's schema.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from fastdeploy_core.errors import ConfigError


@dataclass
class ParsedToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class ParsedReply:
    """What a reply holds: the text outside tool calls (None when empty) and the calls."""

    content: str | None
    tool_calls: list[ParsedToolCall]


def _arguments_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class ToolParser(ABC):
    """Finds tool calls in a model's text (whole, or as a stream grows)."""

    #: The ``--tool-call-parser`` name.
    name: str = ""

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer

    @abstractmethod
    def parse(self, text: str) -> ParsedReply:
        """The calls in the finished reply ``text``; text that is no call stays content."""

    @abstractmethod
    def content_end(self, text: str) -> int:
        """While streaming: how much of ``text`` (the reply so far) is surely plain content. The
        rest may be the start of a tool call and is held back until the reply ends."""


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen, SmolLM2)."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedReply:
        start = text.find(self.START)
        if start < 0:
            return ParsedReply(text or None, [])
        calls = []
        for body in self._CALL.findall(text[start:]):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                return ParsedReply(text or None, [])  # not a call we can hand on: leave the text as it is
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return ParsedReply(text or None, [])
            calls.append(ParsedToolCall(obj["name"], _arguments_text(obj.get("arguments", obj.get("parameters", {})))))
        content = text[:start].strip()
        return ParsedReply(content or None, calls)

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the reply is ``{"name": ..., "parameters": {...}}`` (optionally after
    ``<|python_tag|>``), several separated by ``;``."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedReply:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        if not body.startswith("{"):
            return ParsedReply(text or None, [])
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return ParsedReply(text or None, [])
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return ParsedReply(text or None, [])
            calls.append(ParsedToolCall(obj["name"], _arguments_text(obj.get("parameters", obj.get("arguments", {})))))
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ParsedReply(None, calls)

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or self.TAG.startswith(body[: len(self.TAG)]):
            return 0
        return len(text)


def tool_parser_class(name: str | None, plugin_manager=None) -> type[ToolParser] | None:
    """The registered parser for ``--tool-call-parser NAME`` (None for none); ConfigError
    listing the registered names."""
    if not name:
        return None
    from fastdeploy_core.plugins import get_plugin_manager, import_target

    pm = plugin_manager or get_plugin_manager()
    target = pm.tool_parsers.get(name)
    if target is None:
        known = ", ".join(sorted(pm.tool_parsers.keys())) or "none"
        raise ConfigError(
            f"tool_call_parser: {name!r} is not registered (registered: {known}); see `fastdeploy plugins`",
            param="tool_call_parser",
        )
    return import_target(target)


# --- tool_choice required / named: constrained JSON ------------------------------------------


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON the reply to ``tool_choice: "required"`` must be: calls of the given tools."""
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON the reply to a named ``tool_choice`` must be: that function's arguments."""
    return _parameters(tool)


def calls_from_constrained(text: str, named: str | None) -> list[ParsedToolCall] | None:
    """The calls in a constrained reply; None when it is not complete JSON (``max_tokens`` hit)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if named is not None:
        return [ParsedToolCall(named, json.dumps(value, ensure_ascii=False))]
    if not isinstance(value, list):
        return None
    return [ParsedToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
