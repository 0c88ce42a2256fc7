"""``mtp``: drafts with the target's own multi-token-prediction layer (DeepSeek-V3's).

``--speculative-config '{"method": "mtp", "num_speculative_tokens": K}'`` (FastDeploy's
``num_model_steps``, when given, must equal ``K``). The target model must expose the MTP part of
the model contract (``docs/writing-a-plugin.md``): ``num_mtp_layers`` > 0,
``mtp_kv_cache_layout()`` and ``forward_mtp(meta, previous_hidden, kv_caches, index)``.

An MTP layer reads a pair: the target's last hidden state at position ``p`` and the embedding of
the token at ``p + 1``; the LM head over its output guesses the token at ``p + 2``. So the
proposer needs the target's hidden states: it sets :attr:`wants_hidden_states`, and after each
step :meth:`observe` keeps those of each request (the runner's output after the final norm)
until they are fed to the MTP layer.

Its cache is the runner's MTP cache (:meth:`ModelRunner.mtp_kv_caches`), addressed by the
target's block ids: the MTP row for the pair at ``p`` lives at the slot of the target's position
``p`` in the request's own blocks, so it is freed, preempted and prefix-cached with them and the
proposer holds no blocks. Its rotary position is ``p + 1`` (the token's own, as in transformers'
``MtpLayer``).

Per request the proposer remembers how many MTP rows hold what the layer computed from the
target's hidden states (``computed``). When asked to draft for a request of ``L`` tokens (the
target holds hidden states for positions ``0 .. L - 2``; position ``L - 1`` is computed by the
step about to run):

1. it catches up on rows ``computed .. L - 2`` (after prefill the prompt, in chunks of the step's
   token budget; afterwards the accepted drafts and the target's own token of the last step);
   the last row's output gives the first guess, the token at ``L``;
2. with ``D > 1`` MTP layers (DeepSeek-V3's sequential modules: layer ``j`` reads layer
   ``j - 1``'s output at a row and the token ``j + 1`` after the row's position), layer ``j``
   guesses the token at ``L + j`` from row ``L - 2``: its rows up to ``L - 2 - j`` read known
   tokens and are caught up like layer 0's (each layer keeps the outputs of the layer before it
   until it has read them), its rows ``L - 1 - j .. L - 2`` read the guesses so far;
3. it feeds each further guess back to the last layer run with that layer's own output hidden
   state in place of the one it reads (one layer chained, as FastDeploy's ``num_model_steps``
   and vLLM do), one row per guess for every drafting request at once, until it has
   ``max_tokens`` guesses or the next row would fall beyond the request's blocks.

Rows read from guesses (steps 2 and 3) are written over by the next call's catch-up (a rejected
draft needs no other rollback), and the target's hidden states of rejected drafts
are dropped when the next step recomputes those positions. A request whose first computed
position is past 0 (a prefix-cache hit, a decode instance's prompt computed elsewhere) starts
its MTP rows there: the cached blocks' MTP rows are whatever the request that computed them
left (the same tokens give the same rows, except the last row before the hit, which also read
the next token), which may lower acceptance but never changes the output.

The hidden states of a request that is not asked for drafts for a while (a grammar-constrained
one, steps above ``disable_by_batch_size``) are held until it is (``[positions, H]`` floats) or
until :meth:`forget`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paddle

from fastdeploy_core.config import EngineArgs, SpeculativeConfig
from fastdeploy_core.errors import ConfigError
from fastdeploy_core.executor.forward_meta import ForwardMeta
from fastdeploy_core.spec_decode.base import DraftRequest, Proposer, ProposerContext, pack_chunks


@dataclass
class _MtpState:
    """One request's MTP rows and the target hidden states not yet fed to the MTP layer."""

    #: MTP cache rows ``0 .. computed - 1`` hold what the layer computed from the target's hidden states.
    computed: int
    #: ``(first position, [n, H] tensor)``: the target's hidden states, contiguous, in position order.
    chunks: list[tuple[int, Any]] = field(default_factory=list)

    @property
    def first(self) -> int:
        return self.chunks[0][0] if self.chunks else self.computed

    @property
    def end(self) -> int:
        """One past the last position whose hidden state is held."""
        if not self.chunks:
            return self.computed
        start, rows = self.chunks[-1]
        return start + int(rows.shape[0])

    def keep_before(self, position: int) -> None:
        """Drop the hidden states of ``position`` on (the target computes them again)."""
        kept = []
        for start, rows in self.chunks:
            if start >= position:
                break
            n = int(rows.shape[0])
            kept.append((start, rows if start + n <= position else rows[: position - start]))
        self.chunks = kept

    def drop_before(self, position: int) -> None:
        """Forget the hidden states of positions before ``position`` (fed already)."""
        kept = []
        for start, rows in self.chunks:
            n = int(rows.shape[0])
            if start + n <= position:
                continue
            kept.append((position, rows[position - start :]) if start < position else (start, rows))
        self.chunks = kept

    def rows(self, position: int, n: int):
        """The hidden states of positions ``position .. position + n - 1`` as one ``[n, H]`` tensor."""
        parts = []
        for start, rows in self.chunks:
            size = int(rows.shape[0])
            lo, hi = max(position, start), min(position + n, start + size)
            if lo < hi:
                parts.append(rows[lo - start : hi - start])
        return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=0)


@dataclass
class _Row:
    """One request's work inside a :meth:`MtpProposer.propose` call."""

    index: int  # in the call's request list
    request: DraftRequest
    state: _MtpState  # layer 0's: the target's hidden states
    next: int  # the next MTP row to compute from the target's hidden states
    drafts: list[int] = field(default_factory=list)
    hidden: Any = None  # the last layer run's output at the last row computed, [1, H]
    #: layers 1..: their states (the catch-up outputs of the layer before, not yet fed)
    deeper: list[_MtpState] = field(default_factory=list)
    #: the last deeper layer j's outputs at its rows read from guesses, L - 1 - j .. L - 2 ([j, H])
    guessed_out: Any = None

    @property
    def last(self) -> int:
        """The last row the target's hidden states feed: ``L - 2``."""
        return len(self.request.token_ids) - 2

    def wants_more(self) -> bool:
        return len(self.drafts) < self.request.max_tokens


class MtpProposer(Proposer):
    """Drafts with the target model's MTP layer (see the module docstring)."""

    reads = frozenset({"num_model_steps"})
    wants_hidden_states = True
    uses_mtp_cache = True

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        super().check_config(config)
        steps = config.num_model_steps
        if steps is not None and steps != config.num_speculative_tokens:
            raise ConfigError(
                f"speculative_config.num_model_steps: {steps} MTP steps with num_speculative_tokens "
                f"{config.num_speculative_tokens}; the MTP layer is chained once per draft token, so give them the "
                "same value (or leave num_model_steps out)",
                param="speculative_config.num_model_steps",
            )

    @classmethod
    def check_engine(cls, args: EngineArgs) -> None:
        size = args.parallel.tensor_parallel_size
        if size > 1:
            raise ConfigError(
                f"tensor_parallel_size: method 'mtp' runs the MTP layer in the engine's process, which holds no "
                f"weights under tensor parallelism ({size} ranks); use --tensor-parallel-size 1, or method 'ngram'",
                param="tensor_parallel_size",
            )

    def __init__(self, config: SpeculativeConfig, context: ProposerContext):
        super().__init__(config, context)
        runner = context.runner
        if runner is None:
            raise ConfigError(
                "speculative_config.method: 'mtp' drafts with the target's own layers and needs the target's model "
                "runner; build it through an engine",
                param="speculative_config.method",
            )
        model = runner.model
        layers = int(getattr(model, "num_mtp_layers", 0) or 0)
        if layers < 1 or not hasattr(model, "forward_mtp") or not hasattr(model, "mtp_kv_cache_layout"):
            raise ConfigError(
                f"speculative_config.method: 'mtp' needs multi-token-prediction layers, and the model "
                f"({type(model).__name__}) has none (a DeepSeek-V3 checkpoint declares them with "
                "num_nextn_predict_layers and carries their weights); use method 'ngram' or 'draft_model'",
                param="speculative_config.method",
            )
        self.runner = runner
        self.model = model
        self.num_layers = layers
        self.block_size = runner.block_size
        self.max_num_batched_tokens = runner.max_num_batched_tokens
        #: per request, one state per MTP layer (layer 0's holds the target's hidden states)
        self._states: dict[str, list[_MtpState]] = {}

    # ---- what the target computed ----------------------------------------------------------
    def observe(self, step, result) -> None:
        for row, hidden in zip(step.requests, result.hidden_states):
            start = row.num_computed_tokens
            states = self._states.get(row.request_id)
            state = states[0] if states else None
            if state is None or start < state.computed or start > state.end:
                # New (its first computed position may be past 0: a prefix-cache hit), or not
                # continuing the positions held: the MTP rows of every layer start again here.
                states = self._states[row.request_id] = [_MtpState(computed=start) for _ in range(self.num_layers)]
                state = states[0]
            else:
                state.keep_before(start)
            state.chunks.append((start, hidden))

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    # ---- proposing -------------------------------------------------------------------------
    @paddle.no_grad()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        rows = []
        for i, request in enumerate(requests):
            states = self._states.get(request.request_id)
            if request.max_tokens <= 0 or states is None:
                continue
            row = _Row(i, request, states[0], states[0].computed, deeper=states[1:])
            state = row.state
            # The hidden states of rows computed .. L - 2 must be held (the runner gave them).
            if row.next > row.last or state.first > row.next or state.end <= row.last:
                continue
            rows.append(row)
        out: list[list[int]] = [[] for _ in requests]
        if not rows:
            return out
        from fastdeploy_core.devices.current import set_current_ops

        set_current_ops(self.runner.ops)
        caches = self.runner.mtp_kv_caches()
        # Layer 0 catches up on the rows the target's hidden states feed; a row's last one gives its first guess.
        self._catch_up(rows, 0, lambda row: row.next, lambda row: row.last, caches)
        for row in rows:
            row.state.computed = row.last + 1
            row.state.drop_before(row.state.computed)
        # Layers 1 .. D - 1: layer j guesses the token at L + j from the same row L - 2.
        last_layer = 0
        for j in range(1, self.num_layers):
            deep = [row for row in rows if len(row.drafts) == j and row.wants_more()]
            if not deep:
                break
            last_layer = j
            self._deeper(deep, j, caches)
        # Then each further guess is fed back to the last layer run with its own output in place
        # of the hidden state it reads, one row further each time.
        index = last_layer
        while True:
            step = [
                (row, 1)
                for row in rows
                if row.wants_more()
                and len(row.drafts) >= index + 1
                and (row.next // self.block_size) < len(row.request.block_table)
            ]
            if not step:
                break
            previous = paddle.concat([row.hidden for row, _ in step], axis=0)
            hidden = self._forward(step, [[row.drafts[-1]] for row, _ in step], previous, caches, index)
            for (row, _), end in zip(step, self._guess(step, hidden)):
                row.next += 1
                row.hidden = hidden[end : end + 1]
        for row in rows:
            out[row.index] = row.drafts
        return out

    def _catch_up(self, rows: list[_Row], layer: int, first, last, caches) -> None:
        """Layer ``layer`` over rows ``first(row) .. last(row)`` of each row, in steps of the token
        budget, reading the held hidden states of its state; for layer 0 the last row's output
        gives a guess (its hidden state kept in ``row.hidden``). The outputs go to the next
        layer's state."""
        pending = [row for row in rows if first(row) <= last(row)]
        cursor = {id(row): first(row) for row in pending}
        state_of = (lambda row: row.state) if layer == 0 else (lambda row: row.deeper[layer - 1])
        feeds_next = layer + 1 < self.num_layers
        while pending:
            step = pack_chunks(pending, self.max_num_batched_tokens, lambda row: last(row) + 1 - cursor[id(row)])
            previous = paddle.concat([state_of(row).rows(cursor[id(row)], n) for row, n in step], axis=0)
            tokens = [
                row.request.token_ids[cursor[id(row)] + layer + 1 : cursor[id(row)] + layer + 1 + n] for row, n in step
            ]
            starts = [cursor[id(row)] for row, _ in step]
            hidden = self._forward(step, tokens, previous, caches, layer, starts)
            offset = 0
            guessing = []
            for (row, n), start in zip(step, starts):
                if feeds_next:
                    row.deeper[layer].chunks.append((start, hidden[offset : offset + n]))
                cursor[id(row)] += n
                if layer == 0 and cursor[id(row)] > last(row):  # layer 0's last row guesses
                    row.hidden = hidden[offset + n - 1 : offset + n]
                    row.next = cursor[id(row)]
                    guessing.append(row)
                offset += n
            if guessing:
                for row, token in zip(guessing, self._greedy(paddle.concat([row.hidden for row in guessing], axis=0))):
                    row.drafts.append(token)
            pending = [row for row in pending if cursor[id(row)] <= last(row)]

    def _deeper(self, rows: list[_Row], j: int, caches) -> None:
        """MTP layer ``j`` (>= 1): it reads layer ``j - 1``'s output at a row and the token ``j + 1``
        after it (DeepSeek-V3's sequential MTP modules). Its rows up to ``L - 2 - j`` read known
        tokens (caught up as layer 0's are, then kept); rows ``L - 1 - j .. L - 2`` read guesses,
        and row ``L - 2``'s output guesses the token at ``L + j``."""
        usable = []
        for row in rows:
            state = row.deeper[j - 1]
            known_last = row.last - j
            # Held: layer j - 1's outputs from the layer's computed row through row L - 1 - j.
            if state.first > state.computed or state.end <= known_last + 1:
                continue
            usable.append(row)
        if not usable:
            return
        self._catch_up(usable, j, lambda row: row.deeper[j - 1].computed, lambda row: row.last - j, caches)
        for row in usable:
            state = row.deeper[j - 1]
            state.computed = max(state.computed, row.last - j + 1)
            state.drop_before(state.computed)
        # The guessed rows L - 1 - j .. L - 2, each request at once.
        step = [(row, j) for row in usable]
        previous = paddle.concat(
            [
                paddle.concat([row.deeper[j - 1].rows(row.last + 1 - j, 1)] + ([row.guessed_out] if j > 1 else []), axis=0)
                for row in usable
            ],
            axis=0,
        )
        # Row L - 1 - j reads the token at L (the first guess), row L - 2 the one at L - 1 + j.
        tokens = [row.drafts[:j] for row in usable]
        starts = [row.last + 1 - j for row in usable]
        hidden = self._forward(step, tokens, previous, caches, j, starts)
        ends = [j * (i + 1) - 1 for i in range(len(usable))]
        for i, row in enumerate(usable):
            row.guessed_out = hidden[ends[i] + 1 - j : ends[i] + 1]
            row.hidden = hidden[ends[i] : ends[i] + 1]
        for row, token in zip(usable, self._greedy(paddle.concat([row.hidden for row in usable], axis=0))):
            row.drafts.append(token)

    def _greedy(self, last) -> list[int]:
        greedy = getattr(self.model, "compute_greedy_tokens", None)
        if greedy is not None:
            return [int(t) for t in greedy(last)]
        return [int(t) for t in np.argmax(self.model.compute_logits(last).numpy(), axis=-1)]

    def _forward(self, step: list[tuple[_Row, int]], tokens: list[list[int]], previous, caches, index: int = 0,
                 starts: list[int] | None = None):
        """MTP layer ``index`` over rows ``start .. start + n - 1`` of each ``(row, n)`` (``start``:
        ``starts``, else ``row.next``): the token it reads at each row (``tokens``) with the
        hidden state (``previous``)."""
        bs = self.block_size
        q_lens = np.array([n for _, n in step], dtype=np.int64)
        firsts = np.array(starts if starts is not None else [row.next for row, _ in step], dtype=np.int64)
        query_start_loc = np.zeros(len(step) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num = int(query_start_loc[-1])
        cache_rows = np.arange(num, dtype=np.int64) - np.repeat(query_start_loc[:-1] - firsts, q_lens)
        row_seq = np.repeat(np.arange(len(step)), q_lens)
        block_tables = np.zeros((len(step), max(len(row.request.block_table) for row, _ in step)), dtype=np.int64)
        for i, (row, _) in enumerate(step):
            block_tables[i, : len(row.request.block_table)] = row.request.block_table
        slot_mapping = block_tables[row_seq, cache_rows // bs] * bs + cache_rows % bs
        meta = ForwardMeta(
            input_ids=paddle.to_tensor(np.fromiter((t for ts in tokens for t in ts), dtype=np.int64, count=num)),
            positions=paddle.to_tensor(cache_rows + 1),  # each token's own position
            slot_mapping=paddle.to_tensor(slot_mapping),
            query_start_loc=query_start_loc,
            seq_lens=firsts + q_lens,
            block_tables=block_tables,
            block_size=bs,
            logits_indices=paddle.to_tensor(query_start_loc[1:] - 1),
        )
        return self.model.forward_mtp(meta, previous, caches, index)

    def _guess(self, step: list[tuple[_Row, int]], hidden) -> list[int]:
        """Append the greedy guess of each row (every chunk of ``step`` ends at a guessing row);
        the output row index of every chunk's end, in order."""
        ends = list(np.cumsum([n for _, n in step]) - 1)
        last = paddle.index_select(hidden, paddle.to_tensor(ends, dtype="int64"), axis=0)
        for (row, _), token in zip(step, self._greedy(last)):
            row.drafts.append(token)
        return [int(e) for e in ends]

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["mtp"] = {"num_mtp_layers": int(self.model.num_mtp_layers), "layers_used": self.num_layers}
        return info

    def close(self) -> None:
        self._states.clear()
