"""What a request constrains its output to: one kind of constraint, as plain data.

Standard library only: it travels inside ``SamplingParams`` between the API process and the
engine core (``to_dict`` / ``from_dict``), and the pure-Python parts of the engine read it.
The kinds follow vLLM / FastDeploy's request extras: ``json`` (a JSON schema), ``json_object``
(any JSON object), ``regex``, ``choice`` (one of some strings), ``grammar`` (Lark, or GBNF-style
EBNF with ``::=``) and ``structural_tag`` (free text with constrained tagged segments).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from fastdeploy_core.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class GuidedDecodingParams:
    """Exactly one of the fields is set (``json_object=True`` counts as set).

    ``json`` is a schema as a dict or its JSON text; ``choice`` a non-empty list of strings;
    ``structural_tag`` a dict ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """InvalidRequestError unless exactly one constraint of the right shape is given."""
        given = [k for k in KINDS if self._is_set(k)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"guided decoding takes exactly one constraint of {', '.join(KINDS)}; got "
                f"{', '.join(given) or 'none'}",
                param="guided_decoding",
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"guided_json: not valid JSON: {exc}", param="guided_json") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidRequestError("guided_json: a JSON schema is an object", param="guided_json")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise InvalidRequestError("guided_choice: give a non-empty list of strings", param="guided_choice")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidRequestError(f"guided_{name}: must be a string", param=f"guided_{name}")
        if isinstance(self.structural_tag, str):
            try:
                self.structural_tag = json.loads(self.structural_tag)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"structural_tag: not valid JSON: {exc}", param="structural_tag") from None
        if self.structural_tag is not None and not isinstance(self.structural_tag, dict):
            raise InvalidRequestError("structural_tag: must be a JSON object", param="structural_tag")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._is_set(k))

    def _is_set(self, name: str) -> bool:
        return bool(self.json_object) if name == "json_object" else getattr(self, name) is not None

    def key(self) -> str:
        """The constraint as canonical text: equal constraints share one compiled grammar."""
        value = True if self.kind == "json_object" else getattr(self, self.kind)
        return self.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if self._is_set(f.name)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GuidedDecodingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequestError(
                f"guided_decoding: unknown key(s) {', '.join(unknown)}; known: {', '.join(KINDS)}",
                param="guided_decoding",
            )
        return cls(**data)
