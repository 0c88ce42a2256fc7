"""The ``guidance`` backend: the ``llguidance`` library (Earley parser + lazy lexer, numpy masks).

Every kind of constraint becomes one llguidance grammar: JSON schemas through its JSON compiler
(compact separators, no free whitespace: small models otherwise fill the output with blank
lines), regexes and Lark grammars as given, GBNF-style EBNF (``rule ::= ...``) converted to
Lark, choices as a Lark alternation of string literals, structural tags as tagged segments in
free text. A compiled grammar is one started matcher; each request gets a ``deep_copy`` of it,
which costs microseconds where building the lexer for the vocabulary costs milliseconds.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from fastdeploy_core.errors import InvalidRequestError
from fastdeploy_core.guided.backend import CompiledGrammar, GrammarMatcher, GuidedBackend
from fastdeploy_core.guided.params import GuidedDecodingParams

#: JSON compiler options: compact output, and unknown schema keywords are errors (a schema the
#: backend would silently weaken is refused with its message instead).
_JSON_OPTIONS = {"whitespace_flexible": False, "lenient": False}


def _param_name(params: GuidedDecodingParams) -> str:
    return {"json": "guided_json", "json_object": "response_format"}.get(params.kind, f"guided_{params.kind}")


def grammar_text(params: GuidedDecodingParams) -> str:
    """The llguidance grammar (its JSON form) of ``params``; InvalidRequestError for input its
    compilers refuse outright."""
    import llguidance

    matcher = llguidance.LLMatcher
    kind = params.kind
    try:
        if kind == "json":
            return matcher.grammar_from_json_schema(params.json, defaults=_JSON_OPTIONS)
        if kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if kind == "regex":
            return matcher.grammar_from_regex(params.regex)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in params.choice)
            return matcher.grammar_from_lark(f"start: {alternatives}\n")
        if kind == "grammar":
            text = params.grammar
            if "::=" in text:
                from llguidance.gbnf_to_lark import any_to_lark

                text = any_to_lark(text)
            return matcher.grammar_from_lark(text)
        return _structural_tag_grammar(params.structural_tag)
    except (ValueError, TypeError, AssertionError, KeyError) as exc:
        raise InvalidRequestError(f"{_param_name(params)}: {exc}", param=_param_name(params)) from None


def _structural_tag_grammar(spec: dict[str, Any]) -> str:
    """``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`` (vLLM's shape)."""
    import llguidance

    structures = spec.get("structures")
    triggers = spec.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise ValueError('give "structures" (begin, schema, end) and "triggers", both non-empty lists')
    tags = []
    for s in structures:
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end", ""), str):
            raise TypeError('each structure needs a "begin" string, a "schema" and an "end" string')
        trigger = next((t for t in triggers if isinstance(t, str) and s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structure begin {s['begin']!r} starts with none of the triggers")
        tags.append(
            llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=s.get("schema") or {}, end=s.get("end", ""))
        )
    return llguidance.LLMatcher.grammar_from_lark(llguidance.StructTag.to_grammar(tags))


class LLGuidanceMatcher(GrammarMatcher):
    """An ``llguidance.LLMatcher`` behind the matcher contract."""

    def __init__(self, matcher: Any):
        self._matcher = matcher

    def fill_bitmask(self, row: np.ndarray) -> None:
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.consume_token(int(token_id)))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None if self._matcher.is_error() else None


class LLGuidanceGrammar(CompiledGrammar):
    """A started matcher to copy from."""

    def __init__(self, matcher: Any):
        self._template = matcher

    def matcher(self) -> GrammarMatcher:
        return LLGuidanceMatcher(self._template.deep_copy())


class LLGuidanceBackend(GuidedBackend):
    """``--guided-decoding-backend guidance`` (the default): see the module docstring."""

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        import llguidance

        # The tokenizer's own JSON (tokenizer.json, or the one rebuilt from GGUF metadata);
        # ~2 s for a 50k vocabulary, done once per engine in the compile thread.
        self._lltokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(self.eos_token_ids) or None
        )

    @classmethod
    def check(cls, params: GuidedDecodingParams) -> None:
        import llguidance

        message = llguidance.LLMatcher.validate_grammar(grammar_text(params))
        if message:
            name = _param_name(params)
            raise InvalidRequestError(f"{name}: the guidance backend cannot compile it: {message}", param=name)

    def compile(self, params: GuidedDecodingParams) -> CompiledGrammar:
        import llguidance

        matcher = llguidance.LLMatcher(self._lltokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            name = _param_name(params)
            raise InvalidRequestError(f"{name}: the guidance backend cannot compile it: {matcher.get_error()}",
                                      param=name)
        return LLGuidanceGrammar(matcher)
