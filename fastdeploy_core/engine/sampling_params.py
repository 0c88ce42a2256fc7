"""``SamplingParams``: how one request is decoded, with FastDeploy's field names.

A plain dataclass of builtins, so it crosses the API-process / engine-process boundary as is
(pickle, or ``to_dict`` / ``from_dict`` for msgpack). ``None`` means "not set": unset fields
are filled from the model's ``generation_config.json`` by
:meth:`SamplingParams.with_generation_config_defaults`, then from the built-in defaults.

Every bad value raises :class:`~fastdeploy_core.errors.InvalidRequestError` with ``param``
set to the field and a message giving the allowed range.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from fastdeploy_core.errors import InvalidRequestError
from fastdeploy_core.guided.params import GuidedDecodingParams

#: Most logprobs a request may ask for (per token), as in FastDeploy.
MAX_LOGPROBS = 20

#: Built-in defaults for fields neither the user nor generation_config.json set.
BUILTIN_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}

#: generation_config.json keys that map onto SamplingParams fields.
_GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass
class SamplingParams:
    """Decoding settings of one request.

    ``temperature=0`` means greedy. ``top_k`` 0 or -1 and ``top_p`` 1 disable those filters.
    ``max_tokens=None`` generates until a stop condition or ``max_model_len``.
    ``stop`` strings are matched on the detokenized text (also across token boundaries);
    ``stop_token_ids`` and the model's eos end a request unless ``ignore_eos``; neither ends it
    before ``min_tokens`` tokens. ``logprobs=N`` returns the sampled token's logprob and the
    top ``N``; ``prompt_logprobs=N`` does the same for every prompt token. ``bad_words`` are
    never generated; the tokenizer side turns them into ``bad_words_token_ids``.
    ``guided_decoding`` (a :class:`~fastdeploy_core.guided.params.GuidedDecodingParams` or its
    dict) constrains the output to a JSON schema, regex, choice or grammar; eos is then allowed
    only where the constraint is complete.
    """

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    guided_decoding: GuidedDecodingParams | None = None
    #: Fields set explicitly by generation_config (kept for introspection only).
    _from_generation_config: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            self.stop = list(self.stop)
        if isinstance(self.guided_decoding, dict):
            self.guided_decoding = GuidedDecodingParams.from_dict(self.guided_decoding)
        self.validate()

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        """Raise InvalidRequestError naming the first out-of-range field."""

        def bad(name: str, rule: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name}: got {getattr(self, name)!r}; {rule}", param=name)

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)

        if not is_int(self.n) or not 1 <= self.n <= 128:
            raise bad("n", "must be an integer in [1, 128]")
        if self.temperature is not None and (not is_num(self.temperature) or not 0 <= self.temperature <= 100):
            raise bad("temperature", "must be in [0, 100] (0 = greedy)")
        if self.top_p is not None and (not is_num(self.top_p) or not 0 < self.top_p <= 1):
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < -1):
            raise bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        if self.min_p is not None and (not is_num(self.min_p) or not 0 <= self.min_p <= 1):
            raise bad("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_num(value) or not -2 <= value <= 2:
                raise bad(name, "must be in [-2, 2]")
        if self.repetition_penalty is not None and (
            not is_num(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10
        ):
            raise bad("repetition_penalty", "must be in (0, 10] (1 = off)")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise bad("seed", "must be an integer in [0, 2**64)")
        if self.stop is not None:
            if not all(isinstance(s, str) for s in self.stop):
                raise bad("stop", "must be a string or a list of strings")
            if any(s == "" for s in self.stop):
                raise bad("stop", "stop strings must not be empty")
        if self.stop_token_ids is not None and not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.bad_words is not None and not all(isinstance(w, str) and w for w in self.bad_words):
            raise bad("bad_words", "must be a list of non-empty strings")
        if self.bad_words_token_ids is not None and not all(
            isinstance(seq, list) and seq and all(is_int(t) and t >= 0 for t in seq) for seq in self.bad_words_token_ids
        ):
            raise bad("bad_words_token_ids", "must be a list of non-empty lists of token ids")
        if self.guided_decoding is not None:
            if not isinstance(self.guided_decoding, GuidedDecodingParams):
                raise bad("guided_decoding", "must be a GuidedDecodingParams or its dict")
            self.guided_decoding.validate()

    # ---- resolved values -----------------------------------------------------------------
    def resolved(self, name: str) -> Any:
        """The effective value of a field that may be unset."""
        value = getattr(self, name)
        return BUILTIN_DEFAULTS.get(name) if value is None else value

    @property
    def is_greedy(self) -> bool:
        return self.resolved("temperature") < 1e-5

    def with_generation_config_defaults(self, generation_config: dict | None) -> SamplingParams:
        """A copy whose unset fields take the model's ``generation_config.json`` values.

        With ``do_sample: false`` in the config, an unset temperature becomes 0 (greedy).
        """
        generation_config = generation_config or {}
        updates: dict[str, Any] = {}
        for key, name in _GENERATION_CONFIG_KEYS.items():
            if getattr(self, name) is None and generation_config.get(key) is not None:
                updates[name] = generation_config[key]
        if self.temperature is None and generation_config.get("do_sample") is False:
            updates["temperature"] = 0.0
        if not updates:
            return self
        copy = dataclasses.replace(self, **updates)
        copy._from_generation_config = sorted(updates)
        return copy

    def child(self, index: int) -> SamplingParams:
        """The params of choice ``index`` of an ``n > 1`` request: n=1, seed + index."""
        seed = None if self.seed is None else (self.seed + index) % 2**64
        return dataclasses.replace(self, n=1, seed=seed)

    # ---- wire format ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Builtins only (msgpack/json friendly)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
        if self.guided_decoding is not None:
            data["guided_decoding"] = self.guided_decoding.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Inverse of :meth:`to_dict`; unknown keys raise InvalidRequestError."""
        known = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}", param=unknown[0])
        return cls(**data)
