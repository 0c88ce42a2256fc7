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

import hashlib
import importlib.util
import json
import os
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


#: The function a ``--tool-parser-plugin`` file defines: the hook's name and signature.
TOOL_PARSER_PLUGIN_FUNCTION = "register_tool_parsers"


def load_tool_parser_plugin(path: str | None, plugin_manager=None) -> list[str]:
    """Run the Python file ``path`` (FastDeploy's ``--tool-parser-plugin FILE``) and register the
    tool-call parsers it defines; the names registered (none for no path).

    The file is the ``register_tool_parsers`` hook without a package: it defines
    ``register_tool_parsers(register)`` and calls ``register("name", ParserClass)`` for each
    :class:`ToolParser` subclass, as an installed plugin's hook would. A second load of the same
    file into the same manager registers nothing again (the CLI and the app both load it).
    """
    if not path:
        return []
    from fastdeploy_core.plugins import PluginInfo, get_plugin_manager, import_target

    pm = plugin_manager or get_plugin_manager()
    real = os.path.realpath(path)
    loaded: dict[str, list[str]] = pm.__dict__.setdefault("tool_parser_files", {})
    if real in loaded:
        return loaded[real]
    if not os.path.isfile(real):
        raise ConfigError(f"tool_parser_plugin: {path} is not a file; give the path of a Python file that "
                          f"defines {TOOL_PARSER_PLUGIN_FUNCTION}(register)", param="tool_parser_plugin")
    module_name = f"fastdeploy_tool_parser_plugin_{hashlib.sha256(real.encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, real)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as exc:  # noqa: BLE001 - the user's file: report what it raised
        raise ConfigError(f"tool_parser_plugin: {path} raised {type(exc).__name__}: {exc}; fix the file",
                          param="tool_parser_plugin") from None
    hook = getattr(module, TOOL_PARSER_PLUGIN_FUNCTION, None)
    if not callable(hook):
        raise ConfigError(f"tool_parser_plugin: {path} defines no {TOOL_PARSER_PLUGIN_FUNCTION}(register) "
                          f"function; define it and call register(\"name\", ParserClass) in it",
                          param="tool_parser_plugin")
    info = PluginInfo(name=f"file:{os.path.basename(real)}", distribution=real, version="file", module=module_name)
    names: list[str] = []

    def register(name: str, target: Any) -> None:
        cls = import_target(target)
        if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
            raise ConfigError(f"tool_parser_plugin: {path} registered {name!r} as {cls!r}, which is not a "
                              "subclass of fastdeploy_core.entrypoints.openai.tool_parsers.ToolParser",
                              param="tool_parser_plugin")
        pm.tool_parsers.add(name, cls, info)
        names.append(name)

    hook(register)
    loaded[real] = names
    return names


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
