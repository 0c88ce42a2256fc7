"""Render chat templates (jinja2) in a sandbox, the way transformers does.

Templates come from model files, so they run in jinja2's ``ImmutableSandboxedEnvironment``
with the helpers HF templates expect (``raise_exception``, ``strftime_now``, ``tojson``,
loop controls). Any template failure becomes an :class:`InvalidRequestError` carrying the
template's own message, so a bad conversation is a 400 and never a 500.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fastdeploy_core.errors import InvalidRequestError


class TemplateRaisedError(Exception):
    """Raised by a template's ``raise_exception(message)`` call."""


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
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
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
    **variables,
) -> str:
    """Render ``messages`` with the template ``source``; extra ``variables`` are visible to it."""
    template = compile_template(source)
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except TemplateRaisedError as exc:
        raise InvalidRequestError(f"chat template rejected the conversation: {exc}") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise InvalidRequestError(f"chat template failed: {type(exc).__name__}: {exc}") from None
