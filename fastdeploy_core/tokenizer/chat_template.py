"""Render chat templates (jinja2) in a sandbox, the way transformers does.

Templates come from model files, so they run in jinja2's ``ImmutableSandboxedEnvironment``
with the helpers HF templates expect (``raise_exception``, ``strftime_now``, ``tojson``,
loop controls). Any template failure becomes an :class:`InvalidRequestError` carrying the
template's own message, so a bad conversation is a 400 and never a 500.

The sandbox stops attribute abuse, not cost: ``{{ 'ab ' * 2000000 }}`` is a 108-byte template
that allocates hundreds of MB. Rendering is therefore bounded in size (string/list repetition,
concatenation, powers and width arguments are checked before they run; the output is cut off
past ``max_chars``) and in time (checked at every output chunk, operator and ``range`` step).
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fastdeploy_core.errors import InvalidRequestError

#: Longest rendered prompt, in characters, unless the caller passes its own bound.
DEFAULT_MAX_CHARS = 1_000_000
#: Longest a template may render for, in seconds.
MAX_RENDER_SECONDS = 2.0


class TemplateRaisedError(Exception):
    """Raised by a template's ``raise_exception(message)`` call."""


class TemplateLimitError(Exception):
    """A template would exceed the size or time bound of one rendering."""


_limits = threading.local()  # (max_chars, deadline) of the rendering running in this thread


def _check_time() -> None:
    deadline = getattr(_limits, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise TemplateLimitError(f"rendering took longer than {MAX_RENDER_SECONDS:g} s")


def _check_size(n: float) -> None:
    max_chars = getattr(_limits, "max_chars", DEFAULT_MAX_CHARS)
    if n > max_chars:
        raise TemplateLimitError(f"an expression would build {n:.0f} items or characters; at most {max_chars} are allowed")


def _sized(value) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple, bytes)) else None


def _check_binop(operator: str, left, right) -> None:
    _check_time()
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if _sized(seq) is not None and isinstance(times, int):
                _check_size(_sized(seq) * max(times, 0))
    elif operator == "+":
        if _sized(left) is not None and _sized(right) is not None:
            _check_size(_sized(left) + _sized(right))
    elif operator == "**":
        if isinstance(left, (int, float)) and isinstance(right, (int, float)) and abs(left) > 1 and right > 0:
            _check_size(right * math.log2(abs(left)) / 8)  # bytes of the result
    elif operator == "%" and isinstance(left, str):
        _check_format_widths(left)


_WIDTH = re.compile(r"\d{7,}")


def _check_format_widths(fmt: str) -> None:
    # "%0999999999d" or "{:>999999999}" would allocate the width before anything could check it.
    if _WIDTH.search(fmt):
        _check_size(float("inf"))


def _bounded_range(*args):
    for i in range(*args):
        _check_time()
        yield i


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox plus the size and time checks of one rendering."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def call_binop(self, context, operator, left, right):
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(self, context, obj, /, *args, **kwargs):
        _check_time()
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, int) and not isinstance(arg, bool):
                _check_size(abs(arg))  # widths and counts of str methods (center, ljust, zfill, ...)
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, str) and getattr(obj, "__name__", "") in ("format", "format_map"):
            _check_format_widths(owner)
        return super().call(context, obj, *args, **kwargs)


def _width_checked(filter_fn):
    def checked(*args, **kwargs):
        for arg in (*args[1:], *kwargs.values()):
            if isinstance(arg, int) and not isinstance(arg, bool):
                _check_size(abs(arg))
        if args and isinstance(args[0], str):
            _check_format_widths(args[0])
        return filter_fn(*args, **kwargs)

    return checked


def _raise_exception(message: str):
    raise TemplateRaisedError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Like transformers: no HTML escaping (jinja's built-in tojson would escape <, >, &).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile ``source`` once; InvalidRequestError for a syntax error."""
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    for name in ("center", "indent", "wordwrap", "format", "truncate"):
        env.filters[name] = _width_checked(env.filters[name])
    env.filters["tojson"] = _tojson
    env.globals["range"] = _bounded_range
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(f"chat template has a syntax error at line {exc.lineno}: {exc.message}") from None


def render_chat_template(
    source: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    max_chars: int = DEFAULT_MAX_CHARS,
    **variables,
) -> str:
    """Render ``messages`` with the template ``source``; extra ``variables`` are visible to it.

    The text is at most ``max_chars`` characters and takes at most MAX_RENDER_SECONDS; past
    either bound rendering stops with InvalidRequestError (code ``chat_template_limit``).
    """
    template = compile_template(source)
    _limits.max_chars, _limits.deadline = max_chars, time.monotonic() + MAX_RENDER_SECONDS
    pieces: list[str] = []
    size = 0
    try:
        for piece in template.generate(messages=messages, add_generation_prompt=add_generation_prompt, **variables):
            size += len(piece)
            _check_size(size)
            _check_time()
            pieces.append(piece)
        return "".join(pieces)
    except TemplateLimitError as exc:
        raise InvalidRequestError(f"chat template stopped: {exc}", code="chat_template_limit") from None
    except TemplateRaisedError as exc:
        raise InvalidRequestError(f"chat template rejected the conversation: {exc}") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError,
            RecursionError, MemoryError) as exc:
        raise InvalidRequestError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    finally:
        _limits.max_chars, _limits.deadline = DEFAULT_MAX_CHARS, None
