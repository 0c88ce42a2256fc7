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
2. it feeds each guess back with the layer's own output hidden state in place of the target's
   (one MTP layer chained, as FastDeploy's ``num_model_steps`` and vLLM do), one row per guess
   for every drafting request at once, until it has ``max_tokens`` guesses or the next row
   would fall beyond the request's blocks.

Rows written by step 2 are guesses; the next call starts again at ``L - 1`` and writes over them
(a rejected draft needs no other rollback), and the target's hidden states of rejected drafts
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
    state: _MtpState
    next: int  # the next MTP row to compute from the target's hidden states
    drafts: list[int] = field(default_factory=list)
    hidden: Any = None  # the layer's output at the last row computed, [1, H]

    @property
    def last(self) -> int:
        """The last row the target's hidden states feed: ``L - 2``."""
        return len(self.request.token_ids) - 2


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
        self.block_size = runner.block_size
        self.max_num_batched_tokens = runner.max_num_batched_tokens
        self._states: dict[str, _MtpState] = {}

    # ---- what the target computed ----------------------------------------------------------
    def observe(self, step, result) -> None:
        for row, hidden in zip(step.requests, result.hidden_states):
            start = row.num_computed_tokens
            state = self._states.get(row.request_id)
            if state is None or start < state.computed or start > state.end:
                # New (its first computed position may be past 0: a prefix-cache hit), or not
                # continuing the positions held: the MTP rows start again here.
                state = self._states[row.request_id] = _MtpState(computed=start)
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
            state = self._states.get(request.request_id)
            if request.max_tokens <= 0 or state is None:
                continue
            row = _Row(i, request, state, state.computed)
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
        # Catch up on the rows the target's hidden states feed; a row's last one gives its first guess.
        pending = rows
        while pending:
            step = pack_chunks(pending, self.max_num_batched_tokens, lambda row: row.last + 1 - row.next)
            previous = paddle.concat([row.state.rows(row.next, n) for row, n in step], axis=0)
            tokens = [row.request.token_ids[row.next + 1 : row.next + 1 + n] for row, n in step]
            hidden = self._forward(step, tokens, previous, caches)
            ends = self._guess(step, hidden)
            for (row, n), end in zip(step, ends):
                row.next += n
                if row.next > row.last:
                    row.hidden = hidden[end : end + 1]
            pending = [row for row in pending if row.next <= row.last]
        for row in rows:
            row.state.computed = row.last + 1
            row.state.drop_before(row.state.computed)
        # Then each guess is fed back with the layer's own output in place of the target's.
        while True:
            step = [
                (row, 1)
                for row in rows
                if len(row.drafts) < row.request.max_tokens
                and (row.next // self.block_size) < len(row.request.block_table)
            ]
            if not step:
                break
            previous = paddle.concat([row.hidden for row, _ in step], axis=0)
            hidden = self._forward(step, [[row.drafts[-1]] for row, _ in step], previous, caches)
            for (row, _), end in zip(step, self._guess(step, hidden)):
                row.next += 1
                row.hidden = hidden[end : end + 1]
        for row in rows:
            out[row.index] = row.drafts
        return out

    def _forward(self, step: list[tuple[_Row, int]], tokens: list[list[int]], previous, caches):
        """The MTP layer over rows ``row.next .. row.next + n - 1`` of each ``(row, n)``: the
        token after each position (``tokens``) with the hidden state at it (``previous``)."""
        bs = self.block_size
        q_lens = np.array([n for _, n in step], dtype=np.int64)
        firsts = np.array([row.next for row, _ in step], dtype=np.int64)
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
        return self.model.forward_mtp(meta, previous, caches, 0)

    def _guess(self, step: list[tuple[_Row, int]], hidden) -> list[int]:
        """Append the greedy guess of each row whose chunk ends at its last row; the output
        row index of every chunk's end, in order."""
        ends, guessing = [], []
        offset = 0
        for i, (row, n) in enumerate(step):
            offset += n
            ends.append(offset - 1)
            if row.next + n > row.last:
                guessing.append(i)
        if guessing:
            last = paddle.index_select(hidden, paddle.to_tensor([ends[i] for i in guessing], dtype="int64"), axis=0)
            greedy = getattr(self.model, "compute_greedy_tokens", None)
            if greedy is not None:
                tokens = [int(t) for t in greedy(last)]
            else:
                tokens = [int(t) for t in np.argmax(self.model.compute_logits(last).numpy(), axis=-1)]
            for i, token in zip(guessing, tokens):
                step[i][0].drafts.append(token)
        return ends

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["mtp"] = {"num_mtp_layers": int(self.model.num_mtp_layers), "layers_used": 1}
        return info

    def close(self) -> None:
        self._states.clear()
