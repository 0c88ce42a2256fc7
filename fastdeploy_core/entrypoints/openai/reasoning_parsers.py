"""Reasoning in a model's reply: the parser contract and the built-in ``<think>`` parsers.

Thinking models write their reasoning before the answer, marked by tags (``<think>...</think>``
for DeepSeek-R1 and Qwen3). With ``--reasoning-parser NAME`` (registered through
``register_reasoning_parsers``) the chat endpoint returns that part as ``reasoning_content``,
beside ``content``, and streams it as ``delta.reasoning_content``; usage counts its tokens as
``completion_tokens_details.reasoning_tokens``.

A parser answers one question, :meth:`ReasoningParser.partition`: of the reply so far, which
text is settled reasoning and which settled content. The stream sends what each part grew by, so
a parser holds back a tail that may still turn out to be a tag, and its parts only ever grow:
the streamed deltas then add up to the finished reply's parts exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from fastdeploy_core.errors import ConfigError


@dataclass(frozen=True)
class ReasoningSplit:
    """The settled parts of a reply: ``reasoning`` and ``content`` (tags removed), and
    ``reasoning_chars``, how many characters at the start of the raw text belong to the
    reasoning section, tags included (what usage counts as reasoning tokens)."""

    reasoning: str
    content: str
    reasoning_chars: int


class ReasoningParser(ABC):
    """Splits a model's reply into reasoning and content, whole or while it streams."""

    #: The ``--reasoning-parser`` name.
    name: str = ""

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer

    @abstractmethod
    def partition(self, text: str, finished: bool) -> ReasoningSplit:
        """The reasoning and content of ``text``, the reply so far. While not ``finished``, only
        what later text cannot change; each part of the answer for a longer text starts with the
        part given for a shorter one."""


def _held_back(text: str, tag: str) -> int:
    """Where ``text`` may end in the first characters of ``tag`` (len(text) when it cannot)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class ThinkTagReasoningParser(ReasoningParser):
    """Reasoning between ``start`` and ``end`` tags at the head of the reply; the rest, with its
    leading whitespace dropped, is content.

    ``opened_by_template``: the chat template already wrote the start tag into the prompt, so the
    reply is reasoning from its first token until the end tag (a start tag the model writes
    anyway is dropped), and a reply without an end tag is all reasoning. Otherwise there is
    reasoning only when the reply opens with the start tag; a reply cut inside it (max_tokens)
    is all reasoning.
    """

    start = "<think>"
    end = "</think>"
    opened_by_template = False

    def partition(self, text: str, finished: bool) -> ReasoningSplit:
        body = text.lstrip()
        offset = len(text) - len(body)  # whitespace before the start tag
        if body.startswith(self.start):
            offset += len(self.start)
        elif not finished and self.start.startswith(body):
            return ReasoningSplit("", "", 0)  # may still become the start tag
        elif not self.opened_by_template:
            return ReasoningSplit("", body, 0)  # no reasoning section: all of it is content
        else:
            offset = 0  # the template opened the reasoning: all of the reply belongs to it
        close = text.find(self.end, offset)
        if close < 0:
            stop = len(text) if finished else _held_back(text, self.end)
            return ReasoningSplit(text[offset:stop], "", len(text) if finished else stop)
        after = close + len(self.end)
        content = text[after:].lstrip()
        return ReasoningSplit(text[offset:close], content, after)


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """DeepSeek-R1: its chat template opens ``<think>`` in the prompt, so the reply is reasoning
    until ``</think>``."""

    name = "deepseek_r1"
    opened_by_template = True


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """Qwen3: the reply opens ``<think>`` itself when thinking; with ``enable_thinking: false``
    the template closes an empty think block in the prompt and the reply is all content."""

    name = "qwen3"


def reasoning_parser_class(name: str | None, plugin_manager=None) -> type[ReasoningParser] | None:
    """The registered parser for ``--reasoning-parser NAME`` (None for none); ConfigError listing
    the registered names."""
    if not name:
        return None
    from fastdeploy_core.plugins import get_plugin_manager, import_target

    pm = plugin_manager or get_plugin_manager()
    target = pm.reasoning_parsers.get(name)
    if target is None:
        known = ", ".join(sorted(pm.reasoning_parsers.keys())) or "none"
        raise ConfigError(
            f"reasoning_parser: {name!r} is not registered (registered: {known}); see `fastdeploy plugins`",
            param="reasoning_parser",
        )
    return import_target(target)


def reasoning_token_count(token_ids: list[int], reasoning_chars: int, decode) -> int:
    """How many of ``token_ids`` make up the first ``reasoning_chars`` characters of their text:
    the fewest tokens whose decoded text reaches that length (``decode(ids) -> str``)."""
    if reasoning_chars <= 0:
        return 0
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(token_ids[:mid])) >= reasoning_chars:
            hi = mid
        else:
            lo = mid + 1
    return lo
