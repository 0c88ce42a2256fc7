"""Captured steps: a batch of B sequences with q new tokens each, recorded once per (B, q) and replayed.

A decode step runs the same ops on the same shapes every time; only the data differ (token
ids, positions, KV slots, block tables, sequence lengths). So does a speculative verify step
(every sequence scores its last token and its ``k`` drafts: ``q = 1 + k``) and a draft model's
catch-up step once its sequences are past their prompts. Each shape ``(B, q)`` gets static
input buffers and a meta built on them; the first step of that shape runs the model's forward
through :meth:`ReferenceOps.capture_graph` (the ops table records what it can), the second
records it again if the table can improve on its first recording (the cpu kernels lay the
activations out in one planned arena), and later steps of that shape copy their inputs into the
buffers and replay, skipping the Python layers and the framework's per-op dispatch (on the cpu
kernels about half of a wint4 batch-1 step). The output is the forward's hidden states of all
``B * q`` rows, so the logits of every position and the hidden states a proposer asks for come
from the replay as from the eager forward.

Which steps, and how much memory:

* ``B`` must be in the capture list (default: every size up to ``max_num_seqs``).
* ``q = 1`` (decode steps): captured the first time, as before speculative steps existed.
* ``q > 1``: every sequence the same ``q``, at most :data:`MAX_QUERY_LEN` (1 + the largest
  ``num_speculative_tokens``), and no sequence computing prompt positions (the caller checks
  that). Such a shape is recorded the second time it is seen (a shape seen once, e.g. a verify
  step clipped by a request's length limit, costs nothing), and at most
  :data:`MAX_MULTI_TOKEN_GRAPHS` such shapes keep graphs: a new one frees the graph of the
  shape used least recently. Their memory is bounded by that many arenas of at most
  ``max(capture sizes) * MAX_QUERY_LEN`` tokens (the ``q = 1`` graphs keep one per batch size).
* Ragged steps (different ``q`` per sequence), prompt steps and mixed steps run eagerly.

When a capture is refused (the device does not capture, or the forward used an op that cannot
be recorded) the reason is logged once and later steps of that kind run eagerly: a refused
``q = 1`` capture turns every graph off, a refused ``q > 1`` capture the ``q > 1`` graphs only.
The refused capture's own output is still the step's result. Released graphs free their
intermediate buffers.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict

import numpy as np
import paddle

from fastdeploy_core.executor.forward_meta import ForwardMeta

logger = logging.getLogger(__name__)

#: The most tokens per sequence a captured step takes: a verify step of the largest
#: ``num_speculative_tokens`` (8, ``SpeculativeConfig``) scores 9.
MAX_QUERY_LEN = 9
#: How many shapes ``(B, q > 1)`` keep their graphs at once (a target's verify steps use
#: ``q = 1 + k``, and shorter ones near requests' length limits or when ngram finds fewer; a
#: draft's catch-up uses 2; B follows the running requests).
MAX_MULTI_TOKEN_GRAPHS = 8


class _StaticInput:
    """An int64 tensor whose buffer stays put, refreshed from ``host``, a view of a numpy array
    (the graphs of all batch sizes of one ``q`` view one array each, their first rows). On a
    host device the tensor shares that memory (refreshing is the numpy copy); elsewhere it is
    its own tensor and :meth:`sync` copies the host view over with ``set_value``. Only the host
    path has run: no device here captures graphs yet (the cpu kernels are the one recorder)."""

    def __init__(self, host: np.ndarray, on_host: bool):
        self.host = host
        self.tensor = paddle.utils.dlpack.from_dlpack(host) if on_host else paddle.zeros(list(host.shape), "int64")
        self._on_host = on_host

    def write(self, array: np.ndarray) -> None:
        np.copyto(self.host, array, casting="unsafe")
        self.sync()

    def sync(self) -> None:
        if not self._on_host:
            self.tensor.set_value(self.host)


class _HostInputs:
    """The host arrays behind the static inputs of every batch size of one ``q`` (a step of size
    B uses the first ``B * q`` token rows and the first B sequence rows): one set per ``q``,
    however many sizes are captured."""

    def __init__(self, max_batch: int, q: int, table_width: int):
        self.ids = np.zeros(max_batch * q, dtype=np.int64)
        self.positions = np.zeros(max_batch * q, dtype=np.int64)
        self.slots = np.zeros(max_batch * q, dtype=np.int64)
        self.query_start = np.arange(0, max_batch * q + 1, q, dtype=np.int64)  # q tokens each
        self.seq_lens = np.zeros(max_batch, dtype=np.int64)
        self.tables = np.zeros((max_batch, table_width), dtype=np.int64)


class _Graph:
    """One shape ``(B, q)``: its static inputs, the meta built on them, and the captured forward."""

    def __init__(self, batch: int, q: int, block_size: int, host: _HostInputs, on_host: bool):
        self.batch = batch
        self.q = q
        tokens = batch * q
        self.ids = _StaticInput(host.ids[:tokens], on_host)
        self.positions = _StaticInput(host.positions[:tokens], on_host)
        self.slots = _StaticInput(host.slots[:tokens], on_host)
        self.query_start = _StaticInput(host.query_start[: batch + 1], on_host)  # 0, q, ..., B * q
        self.query_start.sync()
        self.seq_lens = _StaticInput(host.seq_lens[:batch], on_host)
        self.tables = _StaticInput(host.tables[:batch], on_host)
        self.meta = ForwardMeta(
            input_ids=self.ids.tensor,
            positions=self.positions.tensor,
            slot_mapping=self.slots.tensor,
            query_start_loc=self.query_start.host,
            seq_lens=self.seq_lens.host,  # what the Python forward sees while it is recorded
            block_tables=self.tables.host,
            block_size=block_size,
            logits_indices=paddle.arange(q - 1, tokens, q, dtype="int64"),
            tensors={
                "query_start_loc": self.query_start.tensor,
                "seq_lens": self.seq_lens.tensor,
                "block_tables": self.tables.tensor,
            },
        )
        self.captured = None

    def static_tensors(self) -> list:
        return [s.tensor for s in (self.ids, self.positions, self.slots, self.query_start, self.seq_lens, self.tables)]

    def load(self, meta: ForwardMeta) -> None:
        """Copy a step's inputs (host arrays in ``meta``) into the static buffers."""
        self.ids.write(meta.input_ids)
        self.positions.write(meta.positions)
        self.slots.write(meta.slot_mapping)
        self.seq_lens.write(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.tables.host[:, :width] = meta.block_tables
        self.tables.host[:, width:] = 0
        self.tables.sync()


class DecodeGraphs:
    """Captured steps by shape ``(B, q)`` for one model, its KV caches and its ops table (see the
    module docstring for which shapes are captured)."""

    def __init__(self, model, ops, kv_caches, capture_sizes, max_model_len: int, block_size: int):
        self.model = model
        self.ops = ops
        self.kv_caches = kv_caches
        self.capture_sizes = frozenset(int(b) for b in capture_sizes)
        self.block_size = block_size
        self.table_width = -(-max_model_len // block_size)
        first_cache = _flatten(kv_caches)[:1]
        self._on_host = bool(first_cache) and first_cache[0].place.is_cpu_place()
        self._max_batch = max(self.capture_sizes, default=0)
        self._hosts: dict[int, _HostInputs] = {}
        self.disabled_reason: str | None = None
        #: Why ``q > 1`` steps run eagerly (their capture was refused), or None.
        self.multi_token_disabled_reason: str | None = None
        self._graphs: dict[tuple[int, int], _Graph] = {}
        #: How often each ``(B, q > 1)`` was offered (:meth:`accepts`); it is captured at the second.
        self._seen: Counter = Counter()
        #: The ``(B, q > 1)`` holding graphs, least recently used first.
        self._multi_used: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._weights: list | None = None
        #: Replayed steps by ``(B, q)`` (what the graphs saved is visible, and tested).
        self.replays: Counter = Counter()

    def accepts(self, num_seqs: int, query_len: int | None) -> bool:
        """Whether :meth:`run` takes a step of ``num_seqs`` sequences of ``query_len`` new tokens
        each (``None``: ragged, or a step the caller keeps eager); then its meta may hold host
        arrays. A ``q > 1`` step is counted here: it is taken from the second time on."""
        if self.disabled_reason is not None or num_seqs not in self.capture_sizes or query_len is None:
            return False
        if query_len == 1:
            return True
        if query_len < 1 or query_len > MAX_QUERY_LEN or self.multi_token_disabled_reason is not None:
            return False
        key = (num_seqs, query_len)
        if key in self._graphs:
            return True
        self._seen[key] += 1
        return self._seen[key] >= 2

    def may_capture(self, num_seqs: int, query_len: int) -> bool:
        """Whether steps of this shape can be captured at all (no side effect, unlike :meth:`accepts`):
        a caller free to shape its steps (a draft model's catch-up) pads them to such a shape."""
        if self.disabled_reason is not None or num_seqs not in self.capture_sizes or not 1 <= query_len <= MAX_QUERY_LEN:
            return False
        return query_len == 1 or self.multi_token_disabled_reason is None

    @property
    def captured_sizes(self) -> list[int]:
        """The batch sizes whose one-token decode step is captured."""
        return sorted(b for (b, q), g in self._graphs.items() if q == 1 and g.captured is not None)

    @property
    def captured_shapes(self) -> list[tuple[int, int]]:
        """Every captured ``(B, q)``."""
        return sorted(key for key, g in self._graphs.items() if g.captured is not None)

    @property
    def replayable_shapes(self) -> list[tuple[int, int]]:
        """The ``(B, q)`` whose next step is a replay (recorded on their planned arena)."""
        return sorted(key for key, g in self._graphs.items() if g.captured is not None and g.captured.planned)

    def run(self, meta: ForwardMeta):
        """The step's hidden states ``[B * q, H]`` (the graph's output tensor: read it before the
        next step), or ``None`` when this step does not fit the static buffers.

        ``meta`` holds host (numpy) arrays for ``input_ids``, ``positions`` and ``slot_mapping``,
        and ``q`` tokens for each of its sequences (:meth:`accepts` said yes).
        """
        batch = meta.num_seqs
        q = meta.num_tokens // batch
        if meta.block_tables.shape[1] > self.table_width:
            return None  # more blocks than max_model_len needs (the caller runs this step eagerly)
        key = (batch, q)
        graph = self._graphs.get(key)
        if graph is None:
            if q > 1:
                self._make_room()
            host = self._hosts.get(q)
            if host is None:
                host = self._hosts[q] = _HostInputs(self._max_batch, q, self.table_width)
            graph = self._graphs[key] = _Graph(batch, q, self.block_size, host, self._on_host)
        if q > 1:
            self._multi_used[key] = None
            self._multi_used.move_to_end(key)
        graph.load(meta)
        if graph.captured is None or not graph.captured.planned:
            return self._capture(graph)
        self.replays[key] += 1
        return graph.captured.replay()

    def _make_room(self) -> None:
        """Before the graph of a new ``(B, q > 1)``: free the least recently used such graph when
        :data:`MAX_MULTI_TOKEN_GRAPHS` hold graphs already (and the host arrays of its ``q`` when
        no graph uses them any more)."""
        while len(self._multi_used) >= MAX_MULTI_TOKEN_GRAPHS:
            old, _ = self._multi_used.popitem(last=False)
            self._release_where(lambda key: key == old)
            if not any(key[1] == old[1] for key in self._graphs):
                self._hosts.pop(old[1], None)
            logger.debug("freed the captured step of batch size %d, %d tokens each", *old)

    def _capture(self, graph: _Graph):
        """Record this step (the recording computes it). A second recording of a shape replaces
        the first when the ops table can improve on it (the cpu kernels then put the
        activations in one planned arena); both are real steps, nothing is computed twice."""
        if self._weights is None:
            self._weights = list(self.model.parameters()) + list(self.model.buffers()) + _flatten(self.kv_caches)
        previous = graph.captured
        captured = self.ops.capture_graph(
            lambda: self.model.forward(graph.meta, self.kv_caches), self._weights + graph.static_tensors(), previous
        )
        if not captured.ok:
            if graph.q == 1:
                self.disabled_reason = captured.reason
                logger.info("captured steps are off: capturing a decode step was refused (%s)", captured.reason)
                self.release()
            else:
                self.multi_token_disabled_reason = captured.reason
                logger.info(
                    "steps of several tokens per sequence run eagerly: capturing one was refused (%s)", captured.reason
                )
                self._release_where(lambda key: key[1] > 1)
                self._multi_used.clear()
            return captured.output
        if previous is not None:
            previous.release()
        graph.captured = captured
        logger.debug(
            "recorded the step of batch size %d, %d token(s) each (planned: %s)", graph.batch, graph.q, captured.planned
        )
        return captured.output

    def _release_where(self, condition) -> None:
        for key in [key for key in self._graphs if condition(key)]:
            graph = self._graphs.pop(key)
            if graph.captured is not None:
                graph.captured.release()

    def release(self) -> None:
        """Free every captured graph (their buffers); later steps capture again."""
        self._release_where(lambda key: True)
        self._multi_used.clear()


def _flatten(items) -> list:
    out: list = []
    for item in items:
        if isinstance(item, (list, tuple)):
            out.extend(_flatten(item))
        elif isinstance(item, paddle.Tensor):
            out.append(item)
    return out
