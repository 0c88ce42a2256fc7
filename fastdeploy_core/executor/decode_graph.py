"""Captured decode steps: a decode-only batch of B sequences recorded once per B and replayed.

A decode step runs the same ops on the same shapes every time; only the data differ (token
ids, positions, KV slots, block tables, sequence lengths). Each batch size in the capture list
(default: every size up to ``max_num_seqs``) gets static input buffers and a meta built on
them; the first decode step of that size runs the model's forward through
:meth:`ReferenceOps.capture_graph` (the ops table records what it can), the second records it
again if the table can improve on its first recording (the cpu kernels lay the activations out
in one planned arena), and later steps of that size copy their inputs into the buffers and
replay, skipping the Python layers and the framework's per-op dispatch (on the cpu kernels
about half of a wint4 batch-1 step). Prompt steps, mixed steps and sizes outside the list run
eagerly.

When a capture is refused (the device does not capture, or the forward used an op that cannot
be recorded) the reason is logged once and every later step runs eagerly; the refused capture's
own output is still the step's result. Released graphs free their intermediate buffers.
"""

from __future__ import annotations

import logging

import numpy as np
import paddle

from fastdeploy_core.executor.forward_meta import ForwardMeta

logger = logging.getLogger(__name__)


class _StaticInput:
    """An int64 tensor whose buffer stays put, refreshed from ``host``, a view of a numpy array
    (the graphs of all batch sizes view one array each, their first rows). On a host device the
    tensor shares that memory (refreshing is the numpy copy); elsewhere it is its own tensor and
    :meth:`sync` copies the host view over with ``set_value``. Only the host path has run: no
    device here captures graphs yet (the cpu kernels are the one recorder)."""

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
    """The host arrays behind every batch size's static inputs (a step of size B uses the first
    B rows): one set, however many sizes are captured."""

    def __init__(self, max_batch: int, table_width: int):
        self.ids = np.zeros(max_batch, dtype=np.int64)
        self.positions = np.zeros(max_batch, dtype=np.int64)
        self.slots = np.zeros(max_batch, dtype=np.int64)
        self.query_start = np.arange(max_batch + 1, dtype=np.int64)
        self.seq_lens = np.zeros(max_batch, dtype=np.int64)
        self.tables = np.zeros((max_batch, table_width), dtype=np.int64)


class _Graph:
    """One batch size: its static inputs, the meta built on them, and the captured forward."""

    def __init__(self, batch: int, block_size: int, host: _HostInputs, on_host: bool):
        self.batch = batch
        self.ids = _StaticInput(host.ids[:batch], on_host)
        self.positions = _StaticInput(host.positions[:batch], on_host)
        self.slots = _StaticInput(host.slots[:batch], on_host)
        self.query_start = _StaticInput(host.query_start[: batch + 1], on_host)  # 0..batch: one token each
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
            logits_indices=paddle.arange(batch, dtype="int64"),
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
        """Copy a decode step's inputs (host arrays in ``meta``) into the static buffers."""
        self.ids.write(meta.input_ids)
        self.positions.write(meta.positions)
        self.slots.write(meta.slot_mapping)
        self.seq_lens.write(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.tables.host[:, :width] = meta.block_tables
        self.tables.host[:, width:] = 0
        self.tables.sync()


class DecodeGraphs:
    """Decode-step graphs by batch size for one model, its KV caches and its ops table."""

    def __init__(self, model, ops, kv_caches, capture_sizes, max_model_len: int, block_size: int):
        self.model = model
        self.ops = ops
        self.kv_caches = kv_caches
        self.capture_sizes = frozenset(int(b) for b in capture_sizes)
        self.block_size = block_size
        self.table_width = -(-max_model_len // block_size)
        first_cache = _flatten(kv_caches)[:1]
        self._on_host = bool(first_cache) and first_cache[0].place.is_cpu_place()
        self._host = _HostInputs(max(self.capture_sizes, default=0), self.table_width)
        self.disabled_reason: str | None = None
        self._graphs: dict[int, _Graph] = {}
        self._weights: list | None = None

    def accepts(self, num_seqs: int, decode_only: bool) -> bool:
        """Whether :meth:`run` takes a step of ``num_seqs`` sequences (then its meta may hold host arrays)."""
        return decode_only and self.disabled_reason is None and num_seqs in self.capture_sizes

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(b for b, g in self._graphs.items() if g.captured is not None)

    def run(self, meta: ForwardMeta):
        """The step's hidden states ``[B, H]`` (the graph's output tensor: read it before the next
        step), or ``None`` when this step does not fit the static buffers.

        ``meta`` holds host (numpy) arrays for ``input_ids``, ``positions`` and ``slot_mapping``.
        """
        batch = meta.num_seqs
        if meta.block_tables.shape[1] > self.table_width:
            return None  # more blocks than max_model_len needs (the caller runs this step eagerly)
        graph = self._graphs.get(batch)
        if graph is None:
            graph = self._graphs[batch] = _Graph(batch, self.block_size, self._host, self._on_host)
        graph.load(meta)
        if graph.captured is None or not graph.captured.planned:
            return self._capture(graph)
        return graph.captured.replay()

    def _capture(self, graph: _Graph):
        """Record this step (the recording computes it). A second recording of a batch size
        replaces the first when the ops table can improve on it (the cpu kernels then put the
        activations in one planned arena); both are real steps, nothing is computed twice."""
        if self._weights is None:
            self._weights = list(self.model.parameters()) + list(self.model.buffers()) + _flatten(self.kv_caches)
        previous = graph.captured
        captured = self.ops.capture_graph(
            lambda: self.model.forward(graph.meta, self.kv_caches), self._weights + graph.static_tensors(), previous
        )
        if not captured.ok:
            self.disabled_reason = captured.reason
            logger.info("decode steps run eagerly: capturing one was refused (%s)", captured.reason)
            self.release()
            return captured.output
        if previous is not None:
            previous.release()
        graph.captured = captured
        logger.debug("recorded the decode step of batch size %d (planned: %s)", graph.batch, captured.planned)
        return captured.output

    def release(self) -> None:
        """Free every captured graph (their buffers); later steps capture again."""
        for graph in self._graphs.values():
            if graph.captured is not None:
                graph.captured.release()
        self._graphs.clear()


def _flatten(items) -> list:
    out: list = []
    for item in items:
        if isinstance(item, (list, tuple)):
            out.extend(_flatten(item))
        elif isinstance(item, paddle.Tensor):
            out.append(item)
    return out
