"""The model runner: device work only (the scheduler decides, the runner executes).

It builds the model through the plugin registry (device -> ops table -> model class ->
weights), sizes and allocates the paged KV cache, and executes one
:class:`~fastdeploy_core.executor.step_io.SchedulerOutput` per step, returning a
:class:`~fastdeploy_core.executor.step_io.RunnerOutput` (it writes into no engine state):

* every scheduled token of every request is flattened into one ragged batch
  (:class:`~fastdeploy_core.executor.forward_meta.ForwardMeta`: input ids, positions, slot
  mapping, block tables) built on the host with numpy; the model runs once over it;
* logits are computed only for the last token of each sequence that completes its prompt or
  decodes this step (plus all prompt rows of requests asking for ``prompt_logprobs``);
* the :class:`~fastdeploy_core.executor.sampler.Sampler` picks the tokens;
* a row carrying speculative draft tokens (``1 + k`` query tokens) gets the target's token
  (greedy or sampled with the request's seed) at all ``k + 1`` positions and keeps the drafts it
  agrees with;
* decode steps (one token per row) and steps of ``q`` tokens in every row past its prompt
  (speculative verify steps, a draft model's catch-up) replay captured graphs
  (:mod:`fastdeploy_core.executor.decode_graph`, which says which shapes it keeps); ragged,
  prompt and mixed steps run eagerly.

KV cache size: ``--num-gpu-blocks-override`` blocks or ``--kv-cache-memory`` bytes if given;
else the device's default budget (``Device.default_kv_budget``), measured against the memory
free after the weights load: a share of the host's RAM on devices that share it (the cpu),
``gpu_memory_utilization`` of the card's memory minus an activation estimate on devices with
their own; never more than ``max_num_seqs`` sequences of ``max_model_len`` tokens. On the cpu the
cache is zero-initialised lazily (pages are committed by the OS when first written), so the
budget is the most the cache's RAM can grow to, reached as it fills.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import paddle

from fastdeploy_core.config import EngineArgs, check_dtype
from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.errors import ConfigError, ModelLoadError, OutOfKVCacheError
from fastdeploy_core.executor.forward_meta import ForwardMeta
from fastdeploy_core.executor.sampler import Sampler, log_softmax, top_logprobs, verify_drafts
from fastdeploy_core.executor.step_io import RunnerOutput, SchedulerOutput
from fastdeploy_core.host_memory import returned_after_loading
from fastdeploy_core.layers.kv_layout import CACHE_DTYPE_BYTES, KVCacheLayout, kv_cache_layout
from fastdeploy_core.layers.parallel import tp_group

logger = logging.getLogger(__name__)

_DTYPE_BYTES = 4  # float32 activations (the only matmul dtype of Paddle's CPU build)
_MiB = 1 << 20


def default_max_num_batched_tokens(args: EngineArgs, max_model_len: int) -> int:
    """The step token budget when the user gave none."""
    if args.scheduler.max_num_batched_tokens is not None:
        return args.scheduler.max_num_batched_tokens
    if args.scheduler.enable_chunked_prefill:
        return 2048
    return max(2048, max_model_len)


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler; see the module docstring."""

    def __init__(self, args: EngineArgs, plugin_manager=None, with_mtp_cache: bool = False):
        """``with_mtp_cache``: the model's MTP layers' cache is budgeted with the target's (each
        block holds both) and allocated now (the ``mtp`` speculative method drafts with them)."""
        from fastdeploy_core.loader import load_model_weights, resolve_model_source
        from fastdeploy_core.loader.gguf_loader import close_gguf_readers
        from fastdeploy_core.plugins import load_plugins

        self.args = args
        self.with_mtp_cache = with_mtp_cache
        pm = plugin_manager or load_plugins()
        self.device_cls = pm.select_device(args.parallel.device)
        check_dtype(args.model.dtype, self.device_cls.name, tuple(self.device_cls.supported_dtypes))
        paddle.set_device(self.device_cls.paddle_place())
        self.ops = self.device_cls.make_ops(args.parallel.attention_backend)
        set_current_ops(self.ops)

        self.source = resolve_model_source(args.model.model)
        model_cls = self._resolve_model_class(pm)
        paddle.seed(args.model.seed)
        from fastdeploy_core.quantization.kv_cache import Int8KVCacheQuantizer
        from fastdeploy_core.quantization.registry import resolve_quantization

        self.quantizer = resolve_quantization(
            args.quant.quantization,
            device=self.device_cls,
            plugin_manager=pm,
            hf_config=self.source.hf_config,
            gguf_path=self.source.path if self.source.format == "gguf" else None,
        )
        if args.model.dtype == "bfloat16":
            self.quantizer = self._bfloat16_linears(self.quantizer)
        self.kv_quantizer = self.quantizer.kv_cache_method if self.quantizer is not None else None
        #: Storage dtype of a float KV cache: float32, or bfloat16 (``--kv-cache-dtype bfloat16``).
        self.kv_dtype = "bfloat16" if args.cache.kv_cache_dtype == "bfloat16" else "float32"
        if self.kv_dtype == "bfloat16" and self.kv_quantizer is not None:
            raise ConfigError(
                f"kv_cache_dtype: bfloat16 stores K/V as bfloat16, and quantization {self.quantizer.name!r} "
                f"(--quantization or the checkpoint's quantization_config) brings its own {self.kv_quantizer.name} KV "
                "cache; use one: drop --kv-cache-dtype bfloat16, or use a method without a KV cache of its own",
                param="kv_cache_dtype",
            )
        if self.kv_quantizer is None and args.cache.kv_cache_dtype == "int8":
            self.kv_quantizer = Int8KVCacheQuantizer()
        if self.kv_quantizer is not None:
            self.ops = self.kv_quantizer.wrap_ops(self.ops)
            set_current_ops(self.ops)
        with returned_after_loading():
            try:
                self.model = model_cls(self.source.hf_config, quant_config=self.quantizer)
            except ImportError as exc:
                raise self._import_error(pm, exc) from exc
            self._check_kv_dtype()
            load_model_weights(self.model, self.source)
            close_gguf_readers()
        self.model.eval()

        cfg = self.source.hf_config
        self.vocab_size = int(cfg.get("vocab_size", 0))
        max_positions = int(cfg.get("max_position_embeddings") or 2048)
        if args.model.max_model_len is not None and args.model.max_model_len > max_positions:
            raise ConfigError(
                f"max_model_len: got {args.model.max_model_len}; the model supports at most "
                f"{max_positions} positions (max_position_embeddings); lower --max-model-len",
                param="max_model_len",
            )
        self.max_model_len = args.model.max_model_len or max_positions
        self.block_size = args.cache.block_size
        self.max_num_batched_tokens = default_max_num_batched_tokens(args, self.max_model_len)
        self.num_blocks = self._determine_num_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        #: The model's MTP layers' cache (:meth:`mtp_kv_caches`), made now when budgeted, else when first asked for.
        self._mtp_kv_caches: list[tuple] | None = None
        if self.mtp_layout is not None:
            self._mtp_kv_caches = self._allocate_kv_cache(self.num_blocks, self.mtp_layout)
        self.sampler = Sampler()
        self.graphs = self._decode_graphs()
        #: ``(step, layer index)``, called in eager forwards as each decoder layer's KV rows of the
        #: step are written (see ``ForwardMeta.after_layer``); a prefill instance's KV sender.
        self.layer_listener = None

    def _check_kv_dtype(self) -> None:
        """A bfloat16 cache is a key/value cache: a latent cache (multi-head latent attention) is refused."""
        layout = self.kv_layout
        if self.kv_dtype == "bfloat16" and layout.kind != "key_value":
            raise ConfigError(
                f"kv_cache_dtype: bfloat16 is implemented for key/value caches; {self.source.architecture} caches "
                f"one {layout.kind} row per token (multi-head latent attention), which stays float32 (or int8: "
                "--kv-cache-dtype int8); drop --kv-cache-dtype bfloat16 for this model",
                param="kv_cache_dtype",
            )

    @staticmethod
    def _bfloat16_linears(quantizer):
        """``--dtype bfloat16``: the linear layers' method (bfloat16 weights); refused next to a
        quantization method, which stores the same layers in a format of its own."""
        from fastdeploy_core.quantization.bfloat16 import BFloat16Linear

        if quantizer is not None:
            raise ConfigError(
                f"dtype: bfloat16 stores the linear layers in bfloat16, and quantization {quantizer.name!r} "
                "(--quantization or the checkpoint's quantization_config) stores them in its own format; use one: "
                "--dtype float32 (or auto) with the quantization, or bfloat16 without it (an int8 KV cache goes "
                "with bfloat16 as --kv-cache-dtype int8)",
                param="dtype",
            )
        return BFloat16Linear()

    def _decode_graphs(self):
        """Decode-step graphs (``graph_opt`` settings) when on and the model declares its forward
        capturable (only ops-table calls, nothing else with side effects); else ``None``."""
        from fastdeploy_core.executor.decode_graph import DecodeGraphs

        graph_opt = self.args.graph_opt
        if not graph_opt.enabled or not getattr(self.model, "supports_graph_capture", False):
            return None
        if tp_group().size > 1:
            logger.info("captured decode steps are off under tensor parallelism (the collectives are not ops-table calls)")
            return None
        max_seqs = self.args.scheduler.max_num_seqs
        sizes = graph_opt.cudagraph_capture_sizes or range(1, max_seqs + 1)
        return DecodeGraphs(self.model, self.ops, self.kv_caches, sizes, self.max_model_len, self.block_size)

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Hold ``num_blocks`` KV blocks instead (tensor-parallel ranks agree on the smallest count)."""
        if num_blocks == self.num_blocks:
            return
        if self.graphs is not None:
            self.graphs.release()
        self.kv_caches = []
        self.num_blocks = num_blocks
        self.kv_caches = self._allocate_kv_cache(num_blocks)
        if self._mtp_kv_caches is not None:
            self._mtp_kv_caches = None
            self._mtp_kv_caches = self._allocate_kv_cache(num_blocks, self.model.mtp_kv_cache_layout())
        self.graphs = self._decode_graphs()

    def close(self) -> None:
        """Free the captured decode steps, the KV cache and the weights now, not whenever the
        garbage collector gets to them (a process building several engines holds one at a
        time). The runner cannot execute afterwards. Safe to call twice."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        self.kv_caches = []
        self._mtp_kv_caches = None
        self.model = None

    def _resolve_model_class(self, pm):
        from fastdeploy_core.plugins import import_target

        target, impl, why = pm.model_provider(
            self.source.architecture, self.args.model.model_impl, hf_config=self.source.hf_config
        )
        self.model_impl, self.model_impl_reason = impl, why
        logger.info("model %s is served by the %s implementation: %s", self.source.architecture, impl, why)
        try:
            return import_target(target)
        except ImportError as exc:
            raise self._import_error(pm, exc) from exc

    def _import_error(self, pm, exc: ImportError) -> ModelLoadError:
        """A model plugin whose own dependency is missing: say which, and what works instead."""
        native = ", ".join(pm.native_architectures()) or "none installed"
        return ModelLoadError(
            f"the implementation chosen for {self.source.architecture!r} (--model-impl "
            f"{self.args.model.model_impl}) cannot be imported: {exc}; install the missing package "
            f"{exc.name or ''} or use a model with a native implementation ({native})",
            param="model",
        )

    # ---- KV cache --------------------------------------------------------------------------
    @property
    def kv_layout(self) -> KVCacheLayout:
        """The cache layout the model declares (key/value per KV head, or one latent row)."""
        return kv_cache_layout(self.model)

    def _layout_bytes_per_block(self, layout: KVCacheLayout) -> int:
        if self.kv_quantizer is not None:
            return layout.num_layers * self.block_size * self.kv_quantizer.layout_bytes_per_token(layout)
        return layout.num_layers * self.block_size * layout.bytes_per_token(CACHE_DTYPE_BYTES[self.kv_dtype])

    @property
    def mtp_layout(self) -> KVCacheLayout | None:
        """The MTP layers' cache layout when this runner holds their cache (``with_mtp_cache``
        and a model with MTP layers), else ``None``."""
        if not self.with_mtp_cache or int(getattr(self.model, "num_mtp_layers", 0) or 0) < 1:
            return None
        return self.model.mtp_kv_cache_layout()

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of the target's layers, plus the MTP layers' when the runner holds their cache."""
        mtp = self.mtp_layout
        return self._layout_bytes_per_block(self.kv_layout) + (self._layout_bytes_per_block(mtp) if mtp else 0)

    def activation_bytes(self) -> int:
        """Peak temporary memory of one step of ``max_num_batched_tokens`` tokens (an estimate)."""
        cfg = self.source.hf_config
        hidden = int(cfg.get("hidden_size", 0))
        inter = int(cfg.get("intermediate_size", 0))
        heads = int(cfg.get("num_attention_heads", 1))
        tokens = self.max_num_batched_tokens
        context = (
            min(self.max_model_len, tokens + self.block_size) if tokens < self.max_model_len else self.max_model_len
        )
        per_token = 8 * hidden + 4 * inter  # residual, norms, qkv, attention out; gate/up/act
        scores = 3 * heads * tokens * context  # scores, mask, probs of the reference attention
        logits = 2 * self.args.scheduler.max_num_seqs * self.vocab_size
        return _DTYPE_BYTES * (tokens * per_token + scores + logits)

    def _determine_num_blocks(self) -> int:
        """Blocks for the KV cache: ``--num-gpu-blocks-override`` blocks, ``--kv-cache-memory``
        bytes, or the device's default budget (:meth:`Device.default_kv_budget`, which reads
        ``--gpu-memory-utilization`` if given). Refused with the numbers when one
        ``max_model_len`` sequence does not fit; one log line says what was chosen and why."""
        cache = self.args.cache
        needed = -(-self.max_model_len // self.block_size)
        per_block = self.bytes_per_block
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
            how = f"--num-gpu-blocks-override {num_blocks}"
        else:
            mem = self.device_cls.memory_info()
            activation = self.activation_bytes()
            if cache.kv_cache_memory is not None:
                room = mem.free_bytes - activation
                if cache.kv_cache_memory > room:
                    raise OutOfKVCacheError(
                        f"--kv-cache-memory {cache.kv_cache_memory / _MiB:.1f} MiB is more than the "
                        f"{self.device_cls.name} device has: {mem.free_bytes / _MiB:.0f} MiB free after the weights, "
                        f"minus {activation / _MiB:.0f} MiB for activations, leaves {room / _MiB:.0f} MiB; give at most "
                        "that, or lower --max-num-batched-tokens",
                        param="kv_cache_memory",
                    )
                budget_bytes = cache.kv_cache_memory
                how = f"--kv-cache-memory {budget_bytes} bytes"
            else:
                budget = self.device_cls.default_kv_budget(
                    free_bytes=mem.free_bytes,
                    activation_bytes=activation,
                    sequence_bytes=needed * per_block,
                    max_num_seqs=self.args.scheduler.max_num_seqs,
                    gpu_memory_utilization=cache.gpu_memory_utilization,
                )
                budget_bytes, how = budget.bytes, budget.rule
            num_blocks = max(0, budget_bytes // per_block)
        if num_blocks < needed:
            fits = num_blocks * self.block_size
            raise OutOfKVCacheError(
                f"the KV cache holds {num_blocks} blocks of {self.block_size} tokens ({fits} tokens, "
                f"{num_blocks * per_block / _MiB:.1f} MiB, from {how}) but one sequence of max_model_len="
                f"{self.max_model_len} needs {needed} blocks ({needed * per_block / _MiB:.1f} MiB); lower "
                f"--max-model-len to at most {fits}, or give the cache more room: --kv-cache-memory "
                f"{needed * per_block} (bytes) or more, or --num-gpu-blocks-override {needed} or more",
                param="kv_cache_memory" if cache.kv_cache_memory is not None else "max_model_len",
            )
        logger.info(
            "KV cache: %d blocks of %d tokens (%s, %.1f MiB, %d tokens, %.1f sequences of max_model_len %d), from %s",
            num_blocks,
            self.block_size,
            self.kv_quantizer.name if self.kv_quantizer is not None else self.kv_dtype,
            num_blocks * per_block / _MiB,
            num_blocks * self.block_size,
            num_blocks / needed,
            self.max_model_len,
            how,
        )
        self.kv_cache_rule = how
        return int(num_blocks)

    def mtp_kv_caches(self) -> list[tuple]:
        """The cache of the model's multi-token-prediction layers (``mtp_kv_cache_layout()``),
        allocated on first use with as many blocks as the target's and addressed by the same
        block ids: a request's MTP rows live in the blocks the engine's block manager gave it, so
        they are freed, preempted and prefix-cached with its target rows. The ``mtp`` proposer
        asks for it. With ``with_mtp_cache`` (the engine sets it for a proposer that declares
        ``uses_mtp_cache``) it was budgeted with the target's and allocated with it; else it is
        allocated here, beyond the budget (the MTP layers add ``num_mtp_layers / num_layers`` of
        it, e.g. 1/61 for DeepSeek-V3)."""
        if self._mtp_kv_caches is None:
            self._mtp_kv_caches = self._allocate_kv_cache(self.num_blocks, self.model.mtp_kv_cache_layout())
        return self._mtp_kv_caches

    def _allocate_kv_cache(self, num_blocks: int, layout: KVCacheLayout | None = None) -> list[tuple]:
        """Per layer, the cache tensors of the model's declared layout (``(k, v)`` or ``(latent,)``),
        or of ``layout``."""
        layout = layout or self.kv_layout
        if self.kv_quantizer is not None:
            return self.kv_quantizer.allocate_layout(layout, num_blocks, self.block_size, zeros=self.device_cls.zeros)
        return layout.allocate(num_blocks, self.block_size, self.device_cls.zeros, self.kv_dtype)

    # ---- one step --------------------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput, host_only: bool = False) -> ForwardMeta:
        """Flatten the step's scheduled tokens into one ragged batch (host-side numpy).

        ``host_only``: ``input_ids``, ``positions``, ``slot_mapping`` and ``logits_indices`` stay
        numpy arrays (a captured graph copies them into its own buffers)."""
        reqs = out.requests
        q_lens = np.fromiter((r.num_new_tokens for r in reqs), dtype=np.int64, count=len(reqs))
        starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=len(reqs))
        seq_lens = starts + q_lens
        query_start_loc = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        input_ids = np.fromiter(
            (t for r in reqs for t in r.query_token_ids()), dtype=np.int64, count=num_tokens
        )
        row_seq = np.repeat(np.arange(len(reqs)), q_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start_loc[:-1] - starts, q_lens)
        max_blocks = max(len(r.block_table) for r in reqs)
        block_tables = np.zeros((len(reqs), max_blocks), dtype=np.int64)
        for i, r in enumerate(reqs):
            block_tables[i, : len(r.block_table)] = r.block_table
        bs = self.block_size
        slot_mapping = block_tables[row_seq, positions // bs] * bs + positions % bs
        device = (lambda a: a) if host_only else paddle.to_tensor
        return ForwardMeta(
            input_ids=device(input_ids),
            positions=device(positions),
            slot_mapping=device(slot_mapping),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            block_size=bs,
            logits_indices=device(query_start_loc[1:] - 1),
        )

    @paddle.no_grad()
    def execute_model(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step: the sampled token of each row (None mid-prompt), the logprobs of
        the rows whose request asked, and the prompt logprobs computed this step."""
        reqs = out.requests
        if not reqs:
            return RunnerOutput([], [], [])
        # The ops table is process-wide; another engine in this process may have installed its
        # own since (e.g. an int8-KV one), and this model's weights and caches are laid out for ours.
        set_current_ops(self.ops)
        graphs = self.graphs
        hidden = None
        if graphs is not None and graphs.accepts(len(reqs), self._uniform_query_len(reqs)):
            meta = self.prepare_inputs(out, host_only=True)
            hidden = graphs.run(meta)
        if hidden is None:
            meta = self.prepare_inputs(out)
            listener = self.layer_listener
            if listener is not None:
                meta.after_layer = lambda index: listener(out, index)
            hidden = self.model.forward(meta, self.kv_caches)
        result = RunnerOutput([None] * len(reqs), [None] * len(reqs), self._prompt_logprobs(out, meta, hidden))
        result.spec_token_ids = [None] * len(reqs)
        result.spec_logprobs = [None] * len(reqs)
        if out.return_hidden_states:
            # A copy: a captured graph's output buffer is written over by its next replay.
            rows = hidden.clone()
            starts = meta.query_start_loc
            result.hidden_states = [rows[int(starts[i]) : int(starts[i + 1])] for i in range(len(reqs))]
        self._verify_drafts(out, meta, hidden, result)

        sample_rows = [i for i, r in enumerate(reqs) if r.samples and not r.draft_token_ids]
        if not sample_rows:
            return result
        rows = meta.query_start_loc[1:][sample_rows] - 1
        if len(rows) == meta.num_tokens:  # every row is a sequence's last token (a decode step)
            last_hidden = hidden
        else:
            last_hidden = paddle.index_select(hidden, paddle.to_tensor(rows), axis=0)
        sampling = [reqs[i] for i in sample_rows]
        greedy_tokens = getattr(self.model, "compute_greedy_tokens", None)
        if greedy_tokens is not None and self.sampler.all_plain_greedy(sampling):
            # Only each row's argmax is needed: the device's greedy head may skip most logits.
            sampled = self.sampler.greedy_output(greedy_tokens(last_hidden))
        else:
            sampled = self.sampler(self.model.compute_logits(last_hidden), sampling)
        for i, token, lp in zip(sample_rows, sampled.token_ids, sampled.logprobs):
            result.sampled_token_ids[i] = token
            result.logprobs[i] = lp
        return result

    def _uniform_query_len(self, reqs) -> int | None:
        """The new tokens every row of the step has, for a captured step (``decode_graph``): 1 for
        a decode step; ``q > 1`` when every row computes ``q`` tokens past its prompt (a verify
        step of ``1 + k`` tokens, a draft model's catch-up); None for a ragged step, a step with
        prompt positions of more than one token per row, or while a layer listener needs the
        eager forward's per-layer calls."""
        q = reqs[0].num_new_tokens
        if any(r.num_new_tokens != q for r in reqs):
            return None
        if q == 1:
            return 1
        if self.layer_listener is not None or any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
            return None
        return q

    def _verify_drafts(self, out: SchedulerOutput, meta: ForwardMeta, hidden, result: RunnerOutput) -> None:
        """Speculating rows: the target's token at each of the row's ``k + 1`` positions (its
        last token and each draft), then the accepted prefix plus one
        (:func:`~fastdeploy_core.executor.sampler.verify_drafts`) into ``result``.

        A row's token at draft position ``j`` is the one the one-token decode step would take
        had the first ``j`` drafts been emitted: penalties, bad words and the ``min_tokens``
        mask read the row's tokens with those drafts appended (later positions only matter when
        every draft before them was kept), and a sampled row draws with the request's seed at
        that output position (:meth:`Sampler.sample_row`); a row asking for logprobs gets them for
        every token it emits. The engine gives no drafts to rows under a grammar."""
        reqs = out.requests
        spec_rows = [i for i, r in enumerate(reqs) if r.draft_token_ids]
        if not spec_rows:
            return
        positions = np.concatenate([meta.query_start_loc[i] + np.arange(reqs[i].num_new_tokens) for i in spec_rows])
        spec_hidden = paddle.index_select(hidden, paddle.to_tensor(positions), axis=0)
        greedy_tokens = getattr(self.model, "compute_greedy_tokens", None)
        host = None
        if self.sampler.all_plain_greedy([reqs[i] for i in spec_rows]):
            if greedy_tokens is not None:
                targets = [int(t) for t in greedy_tokens(spec_hidden)]
            else:
                targets = [int(t) for t in self.ops.argmax_rows(self.model.compute_logits(spec_hidden))]
        else:
            logits = self.model.compute_logits(spec_hidden)
            host = logits.numpy() if hasattr(logits, "numpy") else np.asarray(logits)
            targets = []
            offset = 0
            for i in spec_rows:
                req, n = reqs[i], reqs[i].num_new_tokens
                for j in range(n):
                    # the row as the one-token step would see it after emitting the first j drafts
                    view = dataclasses.replace(req, all_token_ids=req.all_token_ids + req.draft_token_ids[:j],
                                               draft_token_ids=[]) if j else req
                    targets.append(self.sampler.sample_row(host[offset + j], view))
                offset += n
        offset = 0
        for i in spec_rows:
            n = reqs[i].num_new_tokens
            tokens = verify_drafts(targets[offset : offset + n], reqs[i].draft_token_ids)
            result.spec_token_ids[i] = tokens
            result.sampled_token_ids[i] = tokens[0]
            num = reqs[i].sampling_params.logprobs
            if num is not None:
                entries = [top_logprobs(log_softmax(host[offset + j]), t, num) for j, t in enumerate(tokens)]
                result.spec_logprobs[i] = entries
                result.logprobs[i] = entries[0]
            offset += n

    def _prompt_logprobs(self, out: SchedulerOutput, meta: ForwardMeta, hidden) -> list[list[dict] | None]:
        """Per row: the prompt logprobs of the positions computed this step that the engine does
        not hold yet (``[]`` when none), or None when the request asked for none."""
        result: list[list[dict] | None] = [None] * len(out.requests)
        for i, req in enumerate(out.requests):
            num = req.sampling_params.prompt_logprobs
            if num is None:
                continue
            entries: list[dict] = []
            result[i] = entries
            start = req.num_computed_tokens
            # row for position p predicts prompt token p + 1
            first = max(start, req.prompt_logprobs_from)
            last = min(start + req.num_new_tokens, req.num_prompt_tokens - 1)
            if first >= last:
                continue
            rows = meta.query_start_loc[i] + np.arange(first - start, last - start)
            logits = self.model.compute_logits(paddle.index_select(hidden, paddle.to_tensor(rows), axis=0))
            lps = log_softmax(logits.numpy())
            for k, pos in enumerate(range(first, last)):
                target = req.all_token_ids[pos + 1]
                entries.append(top_logprobs(lps[k], target, num))
        return result

    def _multi_token_capture(self) -> str:
        """How steps of several tokens per sequence are captured, for :meth:`describe`."""
        from fastdeploy_core.executor.decode_graph import MAX_MULTI_TOKEN_GRAPHS, MAX_QUERY_LEN

        if self.graphs.multi_token_disabled_reason:
            return f"steps of several tokens per sequence off: {self.graphs.multi_token_disabled_reason}"
        return (
            f"steps of 2-{MAX_QUERY_LEN} tokens per sequence from their second occurrence "
            f"(at most {MAX_MULTI_TOKEN_GRAPHS} such shapes kept)"
        )

    def describe(self) -> dict:
        """Resolved settings, for ``EngineCore.config_info``."""
        layout = self.kv_layout
        return {
            "model": self.source.path,
            "model_format": self.source.format,
            "architecture": self.source.architecture,
            "model_class": f"{type(self.model).__module__}.{type(self.model).__qualname__}",
            "model_impl": self.model_impl,
            "model_impl_reason": self.model_impl_reason,
            "device": self.device_cls.name,
            "attention_backend": self.ops.attention_backend,
            # bfloat16 (--dtype bfloat16), a quantization method, or float32
            "linear_weights": self.quantizer.name if self.quantizer is not None else "float32",
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "num_gpu_blocks": self.num_blocks,
            "kv_cache_bytes": self.num_blocks * self.bytes_per_block,
            "kv_cache_rule": self.kv_cache_rule,
            "activation_bytes": self.activation_bytes(),
            "kv_cache_spec": {
                "num_layers": layout.num_layers,
                "kind": layout.kind,
                "token_shapes": [list(shape) for shape in layout.token_shapes],
                "bytes_per_token_per_layer": self._layout_bytes_per_block(layout) // (layout.num_layers * self.block_size),
                "mtp_layers": self.mtp_layout.num_layers if self.mtp_layout else 0,
                "dtype": self.kv_quantizer.name if self.kv_quantizer is not None else self.kv_dtype,
            },
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "vocab_size": self.vocab_size,
            "graph_capture": (
                "off"
                if self.graphs is None
                else f"off: {self.graphs.disabled_reason}"
                if self.graphs.disabled_reason
                else f"decode batch sizes {_ranges(sorted(self.graphs.capture_sizes))}; {self._multi_token_capture()}"
            ),
        }


def _ranges(sizes: list[int]) -> str:
    """``[1, 2, 3, 8]`` -> ``"1-3, 8"``."""
    parts: list[list[int]] = []
    for size in sizes:
        if parts and parts[-1][1] == size - 1:
            parts[-1][1] = size
        else:
            parts.append([size, size])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in parts)
