"""Compiling constraints off the engine loop, and each request's matcher state.

:class:`GuidedDecoder` owns one worker thread. The backend is built there first (building the
backend's view of the vocabulary takes seconds), then each new constraint is compiled there in
arrival order; the engine loop only asks whether a request's grammar is ready, so one slow
grammar delays only the requests that wait for it. Compiled grammars are cached by the
constraint's canonical text (:meth:`GuidedDecodingParams.key`), least recently used first out.

:class:`RequestGrammar` is one request's matcher. It follows the request's generated tokens
(:meth:`RequestGrammar.sync`): it accepts the tokens it has not seen and rolls back the ones
the request no longer holds, so whatever the engine does with a request's tokens (recompute
after preemption, tokens dropped) the mask always belongs to the tokens the request has.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fastdeploy_core.guided.backend import CompiledGrammar, GrammarMatcher, GuidedBackend, bitmask_words
from fastdeploy_core.guided.params import GuidedDecodingParams

logger = logging.getLogger(__name__)

#: Compiled grammars kept for reuse.
DEFAULT_CACHE_SIZE = 256


class RequestGrammar:
    """One request's constraint: its compile job, then its matcher and how many tokens it took."""

    __slots__ = ("error", "future", "matcher", "num_accepted")

    def __init__(self, future: concurrent.futures.Future):
        self.future = future
        self.matcher: GrammarMatcher | None = None
        self.num_accepted = 0
        self.error: str | None = None

    @property
    def ready(self) -> bool:
        """Compiled (or failed): the request may be scheduled (a failed one is ended instead)."""
        return self.future.done()

    @property
    def failed(self) -> bool:
        self._start()
        return self.error is not None

    def _start(self) -> None:
        if self.matcher is not None or self.error is not None or not self.future.done():
            return
        try:
            grammar: CompiledGrammar = self.future.result()
            self.matcher = grammar.matcher()
        except Exception as exc:  # noqa: BLE001 - the request ends with this reason
            self.error = f"{type(exc).__name__}: {exc}"

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Make the matcher's state that after ``output_token_ids``."""
        self._start()
        if self.matcher is None or self.error is not None:
            return
        n = len(output_token_ids)
        if n < self.num_accepted:
            self.matcher.rollback(self.num_accepted - n)
            self.num_accepted = n
        while self.num_accepted < n:
            token = output_token_ids[self.num_accepted]
            if not self.matcher.accept(token):
                self.error = self.matcher.error or f"token {token} is not allowed by the grammar"
                return
            self.num_accepted += 1

    def fill_bitmask(self, output_token_ids: Sequence[int], row: np.ndarray) -> bool:
        """Write the allowed next tokens into ``row``; False when the matcher cannot say."""
        self.sync(output_token_ids)
        if self.matcher is None or self.error is not None:
            return False
        self.matcher.fill_bitmask(row)
        return True


class GuidedDecoder:
    """The engine's compile worker and grammar cache for one backend and tokenizer."""

    def __init__(
        self,
        backend_cls: type[GuidedBackend],
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ):
        self.backend_name = backend_cls.name
        self.backend_cls = backend_cls
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(vocab_size)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fd-grammar-compile")
        eos = tuple(eos_token_ids)
        self._backend = self._pool.submit(lambda: backend_cls(load_tokenizer(), vocab_size, eos))
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._cache_size = cache_size
        self.num_compiles = 0

    def _compile(self, params: GuidedDecodingParams) -> CompiledGrammar:
        self.num_compiles += 1
        return self._backend.result().compile(params)

    def submit(self, params: GuidedDecodingParams) -> concurrent.futures.Future:
        """The compile job of ``params`` (a cached one when the same constraint came before)."""
        key = params.key()
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, params)
        self._cache[key] = future
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return future

    def check(self, params: GuidedDecodingParams) -> None:
        """InvalidRequestError with the backend's message when ``params`` cannot compile."""
        self.backend_cls.check(params)

    def new_request(self, params: GuidedDecodingParams) -> RequestGrammar:
        return RequestGrammar(self.submit(params))

    def bitmasks(self, rows: Sequence[tuple[RequestGrammar, Sequence[int]] | None]) -> list[np.ndarray | None]:
        """One bitmask per row (``(state, output tokens)``, or None for an unconstrained row)."""
        if not any(rows):
            return [None] * len(rows)
        masks = np.zeros((len(rows), self.num_words), dtype=np.int32)
        out: list[np.ndarray | None] = []
        for i, row in enumerate(rows):
            if row is not None and row[0].fill_bitmask(row[1], masks[i]):
                out.append(masks[i])
            else:
                out.append(None)
        return out

    def wait(self, states: Sequence[RequestGrammar], timeout: float) -> None:
        """Block up to ``timeout`` s until one of ``states`` is compiled (an idle engine waits here
        instead of spinning)."""
        pending = [s.future for s in states if not s.future.done()]
        if pending:
            concurrent.futures.wait(pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
