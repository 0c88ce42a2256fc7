"""The contract of a guided-decoding backend (what ``register_guided_backends`` registers).

A backend turns a :class:`~fastdeploy_core.guided.params.GuidedDecodingParams` into a compiled
grammar for one tokenizer, and a compiled grammar into per-request matchers. The engine core
calls :meth:`GuidedBackend.compile` in a worker thread (never on the engine loop) and caches
the result by the constraint's text, so a compiled grammar must be safe to share: every request
gets its own :meth:`CompiledGrammar.matcher`. Masks are numpy ``int32`` bitmasks, bit ``t % 32``
of word ``t // 32`` set when token ``t`` may come next (the layout the sampler reads).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from fastdeploy_core.guided.params import GuidedDecodingParams


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return (vocab_size + 31) // 32


class GrammarMatcher(ABC):
    """One request's position in its grammar; follows the tokens the request generated."""

    @abstractmethod
    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the tokens allowed next into ``row`` (int32, ``bitmask_words(vocab)`` long);
        the eos tokens are allowed only where the grammar accepts."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False if the grammar does not allow it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and allows nothing but eos."""

    @property
    @abstractmethod
    def error(self) -> str | None:
        """Why the matcher cannot go on (a rejected token, a resource limit), else None."""


class CompiledGrammar(ABC):
    """A constraint compiled for the engine's tokenizer; shared by every request that uses it."""

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""


class GuidedBackend(ABC):
    """Compiles constraints for one tokenizer.

    Built once per engine, in the compile worker thread, with the engine's tokenizer
    (:class:`fastdeploy_core.tokenizer.Tokenizer`), the width of the model's logits and the
    token ids that end a sequence.
    """

    #: The name of ``--guided-decoding-backend``.
    name: str = ""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)

    @classmethod
    @abstractmethod
    def check(cls, params: GuidedDecodingParams) -> None:
        """Raise :class:`~fastdeploy_core.errors.InvalidRequestError` with the backend's own
        message when ``params`` cannot compile (no tokenizer needed: the API process asks
        before a request is admitted, so a bad schema is a 400)."""

    @abstractmethod
    def compile(self, params: GuidedDecodingParams) -> CompiledGrammar:
        """Compile ``params`` (slow: called in the worker thread); InvalidRequestError on failure."""
