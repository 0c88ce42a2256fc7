"""The cpu device's ops table: every op the model layers need, in plain Paddle.

Chip plugins subclass :class:`ReferenceOps` and override the ops they have fused kernels for;
everything else is inherited. Layers reach the table through
:func:`fastdeploy_core.devices.current.current_ops` and never look at a device name.

Conventions: tensors are Paddle tensors; ``T`` is the number of tokens in the step (all
requests flattened), ``h``/``kvh`` query/key-value heads, ``d`` the head size. Linear weights
use Paddle's ``[in, out]`` layout. KV caches are per layer ``[num_blocks, block_size, kvh, d]``
(a latent cache, :meth:`ReferenceOps.mla_paged_attention`: ``[num_blocks, block_size, 1, L + dr]``).
A key/value cache may be stored in a narrower float than the activations (``--kv-cache-dtype
bfloat16``: float32 K/V rounded to bfloat16, nearest-even, when written; widened back when
read, and the attention computed in the activations' dtype).

Batch-1 decode is dominated by per-op dispatch cost in eager Paddle, so the ops keep their op
count low and derive per-step index tensors once (in ``ForwardMeta.attn_state`` or keyed on
the identity of the step's tensors), not once per layer.
"""

from __future__ import annotations

import atexit
import sys
import weakref

import numpy as np
import paddle
import paddle.nn.functional as F

from fastdeploy_core.devices.host_cpu import paddle_cpu_kernel_safe
from fastdeploy_core.devices.padded_batch import PaddedBatch

try:  # present in CPU builds of Paddle 3.x; the plain formulas below are the fallback
    from paddle.incubate.nn.functional import fused_rms_norm as _fused_rms_norm
    from paddle.nn.functional import swiglu as _swiglu
except ImportError:  # pragma: no cover - depends on the Paddle build
    _fused_rms_norm = None
    _swiglu = None


def bf16_linear_reference(x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None = None) -> paddle.Tensor:
    """The formula of :meth:`ReferenceOps.bf16_linear`: ``x`` rounded to bfloat16 (round to nearest,
    ties to even: Paddle's cast) times the bfloat16 ``weight [in, out]``, both widened to float32,
    summed in float32 (the products are exact there), plus the float32 bias."""
    rounded = x.astype("bfloat16").astype("float32")
    y = paddle.matmul(rounded, weight.astype("float32"))
    return y if bias is None else y + bias


def _cache_view(cache: paddle.Tensor, name: str, keep_dims: int) -> paddle.Tensor:
    """A flat view of a ``[num_blocks, block_size, kvh, d]`` cache keeping its last ``keep_dims`` dims.

    Made once and kept on the cache tensor itself (a view shares its memory), which saves
    four reshape ops per layer and step; it goes away with the cache.
    """
    view = getattr(cache, name, None)
    if view is None:
        view = cache.reshape([-1, *cache.shape[cache.ndim - keep_dims :]])
        setattr(cache, name, view)
    return view


#: Graphs that still hold something a device must free (see :func:`release_captured_graphs`).
_LIVE_GRAPHS: weakref.WeakSet[CapturedGraph] = weakref.WeakSet()
_exit_hook_registered = False


def release_captured_graphs() -> int:
    """Release every captured graph still alive; returns how many were released.

    Runs at interpreter exit (an ``atexit`` hook registered with the first graph that holds
    anything). A graph left for the garbage collector is otherwise released during the
    interpreter's teardown, after the framework has dismantled its eager mode: the kernel call
    then fails inside C++ and the process aborts (status 134) after the script's work is done.
    ``atexit`` hooks run last-registered first, so this one, registered after Paddle's import
    registered its own, runs while Paddle is whole.
    """
    released = 0
    for graph in list(_LIVE_GRAPHS):
        if graph._release is not None:
            graph.release()
            released += 1
    return released


class CapturedGraph:
    """What :meth:`ReferenceOps.capture_graph` returns: the capture run's ``output`` and, when
    ``ok``, a way to run the same work again into the same output tensor."""

    def __init__(
        self, output, replay_fn=None, reason: str = "", release_fn=None, *, planned=True, arena_bytes=0, state=None
    ):
        global _exit_hook_registered
        self.output = output
        self.reason = reason
        #: Bytes the graph keeps for its intermediate results (0 if unknown or none).
        self.arena_bytes = arena_bytes
        #: False: record the same work again (``capture_graph(..., previous=this)``) before
        #: replaying; this graph may hold only what the device learned (the cpu kernels: a
        #: memory plan) and not be replayable itself.
        self.planned = planned
        #: The device's own handle on the captured work (the cpu kernels: the graph's id).
        self.state = state
        self._replay = replay_fn
        self._release = release_fn
        if release_fn is not None:
            _LIVE_GRAPHS.add(self)
            if not _exit_hook_registered:
                atexit.register(release_captured_graphs)
                _exit_hook_registered = True

    @property
    def ok(self) -> bool:
        return self._replay is not None

    def replay(self):
        """Run the captured work again (inputs refreshed in place by the caller); returns ``output``."""
        if self._replay is None:
            raise RuntimeError(f"this graph cannot be replayed: {self.reason}")
        self._replay()
        return self.output

    def release(self) -> None:
        """Free what the graph holds (its buffers, and its references to the weights and caches
        it read); it cannot be replayed afterwards."""
        release, self._replay, self._release = self._release, None, None
        _LIVE_GRAPHS.discard(self)
        if release is not None:
            release()

    def __del__(self):
        # A device keeps captured work in its own registry (the cpu kernels' closures hold the
        # model's weights): dropping the graph must free it, or every engine a process creates
        # would keep its model alive. Not once the interpreter is finalizing: the exit hook has
        # released every graph by then, and the framework may no longer take the call.
        if sys.is_finalizing():
            return
        try:
            self.release()
        except Exception:  # noqa: BLE001 - a destructor must not raise
            pass


class ReferenceOps:
    """Plain-Paddle implementation of every model op (the cpu device's ops table).

    Args:
        attention_backend: name of the attention backend the device selected; the
            reference ops implement ``"paged_reference"`` only, subclasses may offer more.
    """

    attention_backends: tuple[str, ...] = ("paged_reference",)

    def __init__(self, attention_backend: str = "paged_reference"):
        if attention_backend not in self.attention_backends:
            raise ValueError(
                f"{type(self).__name__} implements attention backends "
                f"{', '.join(self.attention_backends)}, not {attention_backend!r}"
            )
        self.attention_backend = attention_backend
        # Per-step derived tensors, keyed on the identity of the step's input tensors (the
        # same tensor object is passed to every layer of one forward).
        self._rope_key: tuple | None = None
        self._rope_value: tuple | None = None

    #: Output width from which :meth:`linear` over 8-64 rows takes the transposed product.
    wide_linear_min_out: int = 16384

    # ---- dense ops ------------------------------------------------------------------------
    def embedding(self, ids: paddle.Tensor, weight: paddle.Tensor) -> paddle.Tensor:
        """Rows of ``weight [V, H]`` for ``ids [T]`` -> ``[T, H]``."""
        return paddle.index_select(weight, ids, axis=0)

    def int8_embedding(self, ids: paddle.Tensor, weight: paddle.Tensor, scale: paddle.Tensor, group_size: int):
        """Rows of an int8 table ``weight [V, H]`` for ``ids [T]``, widened: ``weight[id, k] *
        scale[id, k // group_size]`` (``scale [V, ceil(H / group_size)]``) -> float32 ``[T, H]``."""
        rows = paddle.gather(weight, ids, axis=0).astype("float32")  # no int8 index_select on cpu
        row_scale = paddle.gather(scale, ids, axis=0)
        if int(row_scale.shape[1]) > 1:
            hidden = int(weight.shape[1])
            row_scale = paddle.repeat_interleave(row_scale, group_size, axis=1)[:, :hidden]
        return rows * row_scale

    def prepare_linear_weight(self, weight: paddle.Tensor) -> paddle.Tensor | None:
        """The layout this table's linear ops read fastest, for a loaded weight ``[rows, out]``.

        Called once per linear layer after loading, with the float32 ``[in, out]`` weight or
        a quantizer's weight storage (int8 ``[in, out]``, int4 ``[in / 2, out]``, fp8). ``None``
        (here) keeps the layout; a table that returns a tensor gets it as the layer's weight, and
        its :meth:`linear` and quantized linear ops must accept it (the cpu device packs column
        tiles, see :class:`fastdeploy_core.builtin.cpu.ops.CpuOps`).
        """
        return None

    def prepare_expert_weight(self, weight: paddle.Tensor) -> paddle.Tensor | None:
        """The layout this table's :meth:`fused_moe` reads fastest, for a layer's stacked float32
        experts ``[E, in, out]`` (``w13`` or ``w2``), called once after loading. ``None`` (here)
        keeps the layout; a returned tensor becomes the layer's weight, and
        :meth:`unprepare_linear_weight` must give ``[E, in, out]`` back from it."""
        return None

    def prepare_int4_weights(
        self, weight: paddle.Tensor, scale: paddle.Tensor, offset: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor] | None:
        """A layout for an int4 layer's codes ``uint8 [in / 2, out]``, scales and offsets
        ``[G, out]`` taken together, for tables whose int4 kernels want all three rearranged.

        ``None`` (here) leaves the layer to :meth:`prepare_linear_weight` of its codes alone.
        """
        return None

    def unprepare_linear_weight(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """The plain ``[rows, out]`` storage of a tensor that :meth:`prepare_linear_weight` or
        :meth:`prepare_int4_weights` returned (the layout the quantizers' reference formulas
        and ``dequantize`` read); a tensor this table never prepared is returned as it is."""
        return tensor

    def prepare_quantization(self) -> None:
        """Called while a quantized model's layers are created, before any weight loads: a table
        that compiles or loads kernels for quantized layers does it here rather than in the
        first request. Nothing to do here."""

    #: Whether attention over a step that mixes prompt chunks and single-token decodes costs
    #: what each sequence's own query rows cost. ``False`` (here): the reference pads every
    #: sequence of a step to its longest query run, so the scheduler keeps prompt steps and
    #: decode steps apart (:func:`fastdeploy_core.engine.engine_core.mixes_prefill_and_decode`).
    ragged_attention: bool = False

    def linear(self, x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None = None) -> paddle.Tensor:
        """``x [..., in] @ weight [in, out] (+ bias)`` -> ``[..., out]``."""
        if bias is None:
            if x.ndim == 2 and weight.shape[1] >= self.wide_linear_min_out and 8 <= x.shape[0] <= 64:
                # Paddle's MKL sgemm is 1.3-1.5x faster computing (W^T x^T)^T for a few rows
                # times a very wide weight (the LM head: batch-16 decode 39 -> 26 ms); the
                # transposed result is a view that argmax and .numpy() read as fast.
                return paddle.transpose(paddle.matmul(weight, x, transpose_x=True, transpose_y=True), [1, 0])
            return paddle.matmul(x, weight)
        return F.linear(x, weight, bias)

    def bf16_linear(self, x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None = None) -> paddle.Tensor:
        """The linear layers of ``--dtype bfloat16``: float32 ``x [..., in]`` (or bfloat16, values
        already rounded), bfloat16 ``weight [in, out]`` (or the layout :meth:`prepare_linear_weight`
        gave it) -> float32 ``[..., out]``.

        ``x`` is rounded to bfloat16 (round to nearest, ties to even, as Paddle's cast), each
        product of two bfloat16 values is exact in float32, and the products are summed in
        float32, in an order the op chooses (orders differ by float32 rounding only), plus the
        bias (float32). See :func:`bf16_linear_reference`.
        """
        return bf16_linear_reference(x, self.unprepare_linear_weight(weight), bias)

    def rms_norm(self, x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
        """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis, in float32."""
        if _fused_rms_norm is not None and paddle_cpu_kernel_safe(x):
            return _fused_rms_norm(x, weight, None, eps, begin_norm_axis=x.ndim - 1)[0]
        variance = paddle.mean(x * x, axis=-1, keepdim=True)
        return x * paddle.rsqrt(variance + eps) * weight

    def add_rms_norm(
        self, x: paddle.Tensor, residual: paddle.Tensor | None, weight: paddle.Tensor, eps: float
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Fused residual add then RMSNorm: returns ``(rms_norm(x + residual), x + residual)``.

        ``residual`` is ``None`` for the first layer; then the residual stream starts at ``x``.
        """
        if residual is None:
            return self.rms_norm(x, weight, eps), x
        if _fused_rms_norm is not None and paddle_cpu_kernel_safe(x):
            normed, summed = _fused_rms_norm(x, weight, None, eps, begin_norm_axis=x.ndim - 1, residual=residual)
            return normed, summed
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def silu_and_mul(self, x: paddle.Tensor) -> paddle.Tensor:
        """``silu(x[..., :I]) * x[..., I:]`` for ``x [..., 2I]`` (gate and up merged)."""
        if _swiglu is not None:
            return _swiglu(x)
        gate, up = paddle.chunk(x, 2, axis=-1)
        return F.silu(gate) * up

    def linear_silu_and_mul(self, x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None = None) -> paddle.Tensor:
        """``silu_and_mul(linear(x, weight, bias))``: a merged gate/up projection (``weight``
        [K, 2I] or the table's prepared layout) and its SwiGLU. A table with one kernel for both
        (its product then never goes through memory) overrides this and gives the composition's
        values."""
        return self.silu_and_mul(self.linear(x, weight, bias))

    def fused_moe(
        self,
        x: paddle.Tensor,
        w13: paddle.Tensor,
        w2: paddle.Tensor,
        topk_weights: paddle.Tensor,
        topk_ids: paddle.Tensor,
    ) -> paddle.Tensor:
        """The routed experts of a mixture-of-experts layer, SwiGLU experts.

        ``x [T, H]``; ``w13 [E, H, 2I]`` (each expert's gate then up projection, ``[in, out]``),
        ``w2 [E, I, H]``; ``topk_weights`` float32 ``[T, k]`` and ``topk_ids`` int64 ``[T, k]``
        (the router's choice). Returns ``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) *
        up_e(x_t))`` with ``e = topk_ids[t, j]``, ``[T, H]``. Here the (token, choice) rows are
        sorted by expert and each expert used in the step runs as two matmuls over its rows; a
        device may use a grouped kernel instead.
        """
        num_tokens, top_k = topk_ids.shape
        flat = topk_ids.reshape([-1])
        order = paddle.argsort(flat, stable=True)  # (token, choice) rows grouped by expert
        counts = paddle.bincount(flat, minlength=w13.shape[0]).numpy()
        rows = paddle.index_select(x, order // top_k, axis=0)
        outs, start = [], 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                hidden = self.silu_and_mul(paddle.matmul(rows[start : start + count], w13[expert]))
                outs.append(paddle.matmul(hidden, w2[expert]))
                start += count
        grouped = paddle.concat(outs, axis=0) if len(outs) > 1 else outs[0]
        per_choice = paddle.scatter(paddle.zeros_like(grouped), order, grouped)  # back to (token, choice) order
        per_choice = per_choice.reshape([num_tokens, top_k, -1]) * topk_weights.astype(x.dtype).unsqueeze(-1)
        return paddle.sum(per_choice, axis=1)

    # ---- captured steps ----------------------------------------------------------------------
    def capture_graph(self, forward, static_tensors: list, previous: "CapturedGraph | None" = None) -> "CapturedGraph":
        """Run ``forward()`` once and keep its device work so :meth:`CapturedGraph.replay` can
        run it again on the same buffers without Python (the counterpart of a CUDA graph).

        ``static_tensors``: every tensor the forward may read that is not produced inside it
        (weights, caches, the step's inputs, which the caller refreshes in place before each
        replay). ``previous``: an earlier recording of the same work, which a device may learn
        from (the cpu kernels plan one memory arena for the activations from it; ``planned``
        says whether a graph is final). The result always carries ``forward``'s output; ``ok``
        says whether it can be replayed, ``reason`` why not. The reference ops capture nothing:
        a device whose ops can be recorded (the cpu kernels, a CUDA graph) overrides this.
        """
        return CapturedGraph(forward(), None, "this device's ops table does not capture graphs")

    # ---- sampling ----------------------------------------------------------------------------
    def argmax_rows(self, logits: paddle.Tensor) -> np.ndarray:
        """Greedy tokens: the index of each row's largest logit (the first on ties) as int64 ``[B]``."""
        return paddle.argmax(logits, axis=-1).numpy().reshape(-1)

    def prepare_greedy_head(self, weight: paddle.Tensor) -> tuple | None:
        """What :meth:`greedy_lm_head` needs besides the head's weight, built once after loading.

        Called by the float32 LM head with its weight as :meth:`prepare_linear_weight` left it;
        whatever it returns comes back as ``prepared``. ``None`` here: the reference computes
        the logits.
        """
        return None

    def greedy_lm_head(
        self, hidden: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None = None, prepared=None
    ) -> np.ndarray:
        """Greedy tokens straight from the LM head: exactly ``argmax_rows(linear(hidden, weight, bias))``.

        ``hidden [B, H]``, ``weight`` the float32 head in this table's linear layout, ``prepared``
        :meth:`prepare_greedy_head`'s result. A table may skip most of the logits (only each
        row's argmax is needed) but must return the very tokens of its own ``linear`` and
        ``argmax_rows`` for the same batch, ties and NaN included.
        """
        return self.argmax_rows(self.linear(hidden, weight, bias))

    # ---- rotary position embedding --------------------------------------------------------
    def rotary_embedding(
        self,
        positions: paddle.Tensor,
        q: paddle.Tensor,
        k: paddle.Tensor | None,
        cos_sin_cache: paddle.Tensor,
    ) -> tuple[paddle.Tensor, paddle.Tensor | None]:
        """Rotate ``q [T, h, d]`` and ``k [T, kvh, d]`` by their positions (HF rotate_half style).

        ``cos_sin_cache [max_positions, 2, d]`` holds ``cos`` and a signed ``sin`` per position
        (built by :mod:`fastdeploy_core.layers.rotary`): with ``sin_signed = [-sin, sin]`` the
        rotation ``x * cos + rotate_half(x) * sin`` becomes ``x * cos + roll(x, d/2) * sin_signed``.
        ``k`` may be ``None`` (then only ``q`` is rotated). The cos/sin gather is done once per
        step and reused while the same ``positions`` tensor object comes back (every layer of
        one forward), so a runner must pass a new ``positions`` tensor each step, never refill one.
        """
        cos, sin = self._rope_cos_sin(positions, cos_sin_cache)
        half = q.shape[-1] // 2
        q = q * cos + paddle.roll(q, half, axis=-1) * sin
        if k is not None:
            k = k * cos + paddle.roll(k, half, axis=-1) * sin
        return q, k

    def _rope_cos_sin(self, positions: paddle.Tensor, cache: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        key = self._rope_key
        if key is not None and key[0] is positions and key[1] is cache:
            return self._rope_value
        rows = paddle.index_select(cache, positions, axis=0)  # [T, 2, d]
        cos = rows[:, 0:1, :]  # [T, 1, d], broadcast over heads
        sin = rows[:, 1:2, :]
        self._rope_key = (positions, cache)
        self._rope_value = (cos, sin)
        return cos, sin

    # ---- paged KV cache -------------------------------------------------------------------
    def write_kv_cache(
        self,
        k: paddle.Tensor,
        v: paddle.Tensor,
        k_cache: paddle.Tensor,
        v_cache: paddle.Tensor,
        slot_mapping: paddle.Tensor,
    ) -> None:
        """Store this step's ``k``/``v [T, kvh, d]`` at ``slot_mapping [T]``, in place.

        A slot is ``block_id * block_size + offset``; caches are ``[num_blocks, block_size, kvh, d]``.
        A cache of another dtype than ``k`` (a bfloat16 cache) stores ``k``/``v`` cast to it
        (Paddle's cast: round to nearest, ties to even).
        """
        if k_cache.dtype != k.dtype:
            # Paddle's CPU scatter has no bfloat16 kernel; index_put_ on the flat view does.
            _cache_view(k_cache, "_fd_slot_view", 2).index_put_((slot_mapping,), k.astype(k_cache.dtype))
            _cache_view(v_cache, "_fd_slot_view", 2).index_put_((slot_mapping,), v.astype(v_cache.dtype))
            return
        # scatter_ on a flat view of the cache writes in place and costs a fraction of index_put_.
        paddle.scatter_(_cache_view(k_cache, "_fd_slot_view", 2), slot_mapping, k, overwrite=True)
        paddle.scatter_(_cache_view(v_cache, "_fd_slot_view", 2), slot_mapping, v, overwrite=True)

    def paged_attention(
        self,
        q: paddle.Tensor,
        k_cache: paddle.Tensor,
        v_cache: paddle.Tensor,
        meta,
        scale: float,
        sliding_window: int | None = None,
    ) -> paddle.Tensor:
        """Causal attention of every new token over its sequence's whole cached context (only its
        last ``sliding_window`` positions, the token's own included, when that is set).

        ``q [T, h, d]``; the step's own K/V must already be written into the caches. Handles
        prefix-cached blocks, chunked prefill, mixed prefill+decode batches and GQA without a
        per-request loop: the batch is padded to ``[B, max_q]`` queries over ``[B, max_kv]``
        cache positions gathered block-wise from ``meta.block_tables``, with a mask
        ``kv_pos <= q_pos``. Returns ``[T, h, d]``. Caches of a narrower dtype than ``q``
        (bfloat16) are widened to ``q``'s dtype as they are gathered, and attention over them
        multiplies in that dtype: the scaled queries and the softmax weights are rounded to it
        (nearest, ties to even) before their products, which are added in ``q``'s dtype (what
        vLLM's and flash-attention's bfloat16 kernels compute; the softmax itself stays float32).
        The weights rounded are exp(s - M) with M the smallest multiple of ln 2 >= the row's
        largest score, the normalising sum taken before rounding (:func:`_rounded_softmax_matmul`):
        a tiled kernel's online maximum kept on that lattice rounds every weight alike.
        """
        key = "paged_reference" if not sliding_window else f"paged_reference/window={int(sliding_window)}"
        state = meta.attn_state.get(key)
        if state is None:
            state = self._build_attention_state(meta, k_cache.shape[1], sliding_window)
            meta.attn_state[key] = state
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        batch, max_q, max_kv = state["batch"], state["max_q"], state["max_kv"]

        # Gather [B, kvh, max_kv, d] directly, one row of d per (sequence, kv head, position):
        # a gather of whole blocks needs a transpose after it, and Paddle's CPU kernels copy
        # such a strided view ~50x slower than this gather (batch-16 decode: 1.8 vs 0.03 ms).
        rows = self._kv_rows(state, num_kv_heads)
        shape = [batch, num_kv_heads, max_kv, head_dim]
        k = paddle.index_select(_cache_view(k_cache, "_fd_row_view", 1), rows, axis=0).reshape(shape)
        v = paddle.index_select(_cache_view(v_cache, "_fd_row_view", 1), rows, axis=0).reshape(shape)
        narrow = k.dtype if k.dtype != q.dtype else None
        if narrow is not None:
            k, v = k.astype(q.dtype), v.astype(q.dtype)

        def rounded(x):  # to the cache's dtype and back: the multiplies of a narrow cache
            return x if narrow is None else x.astype(narrow).astype(x.dtype)

        def weighted(scores, values):  # softmax(scores) @ values, in the cache's multiplies
            if narrow is None:
                return paddle.matmul(F.softmax(scores, axis=-1), values)
            return _rounded_softmax_matmul(scores, values, rounded)

        if max_q == 1:
            # Decode: one query row per sequence, already in batch order. Query heads of one
            # KV head are adjacent (head i reads kv head i // group), so no repeat of K/V.
            qg = rounded(q * scale).reshape([batch, num_kv_heads, group, head_dim])
            scores = paddle.matmul(qg, k, transpose_y=True)  # [B, kvh, g, max_kv]
            if state["mask"] is not None:
                scores = scores + state["mask"]  # [B, 1, 1, max_kv]
            return weighted(scores, v).reshape([num_tokens, num_heads, head_dim])

        if state["pad_rows"] is not None:
            q = paddle.index_select(q, state["pad_rows"], axis=0)  # [B * max_q, h, d]
        q = rounded(q * scale).reshape([batch, max_q, num_kv_heads, group, head_dim])
        # Long prefills attend in query chunks so the score tensor stays bounded.
        chunk = max(1, self.max_score_elements // (batch * num_heads * max_kv))
        outs = []
        for start in range(0, max_q, chunk):
            stop = min(max_q, start + chunk)
            mask = self._score_mask(state, num_kv_heads, group, start, stop)
            outs.append(self._prefill_attention(q[:, start:stop], k, v, mask, weighted))
        out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=1)  # [B, max_q, h, d]
        out = out.reshape([batch * max_q, num_heads, head_dim])
        if state["unpad_rows"] is not None:
            out = paddle.index_select(out, state["unpad_rows"], axis=0)
        return out

    def rope_paged_attention(
        self,
        qkv: paddle.Tensor,
        positions: paddle.Tensor,
        cos_sin_cache: paddle.Tensor,
        k_cache,
        v_cache,
        meta,
        num_heads: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> paddle.Tensor:
        """The attention block between the QKV and output projections, as one op.

        ``qkv [T, (h + 2 kvh) * d]`` (a fused projection, heads in q, k, v order): rotate the
        query and key heads (:meth:`rotary_embedding`), store keys and values
        (:meth:`write_kv_cache`), attend (:meth:`paged_attention`). Returns ``[T, h * d]``.
        Here it is those three ops; a device may fuse them (the cpu device does).
        """
        head_dim = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
        qkv = qkv.reshape([-1, num_heads + 2 * num_kv_heads, head_dim])
        # Rotate Q and K heads together: one set of RoPE ops instead of two.
        qk, v = paddle.split(qkv, [num_heads + num_kv_heads, num_kv_heads], axis=1)
        qk, _ = self.rotary_embedding(positions, qk, None, cos_sin_cache)
        q, k = paddle.split(qk, [num_heads, num_kv_heads], axis=1)
        self.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.paged_attention(q, k_cache, v_cache, meta, scale, sliding_window)
        return out.reshape([-1, num_heads * head_dim])

    # ---- multi-head latent attention --------------------------------------------------------
    #: The forms :meth:`mla_paged_attention` computes: ``auto`` takes ``absorbed`` for a
    #: decode-only step and ``expanded`` otherwise; the other two force one (the kit compares them).
    mla_forms: tuple[str, ...] = ("auto", "absorbed", "expanded")

    def mla_paged_attention(
        self,
        q: paddle.Tensor,
        latent: paddle.Tensor,
        latent_cache: paddle.Tensor,
        meta,
        w_kv: paddle.Tensor,
        scale: float,
        form: str = "auto",
    ) -> paddle.Tensor:
        """Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

        ``q [T, h, dn + dr]``: each head's non-rotary part then its rotary part (rotary already
        applied). ``latent [T, L + dr]``: each new token's normalised latent ``c`` then its
        rotated key ``k_pe``, shared by all heads; written into ``latent_cache [num_blocks,
        block_size, 1, L + dr]`` at ``meta.slot_mapping``. ``w_kv [h, L, dn + dv]``: per head,
        the up-projection of the latent into the non-rotary key (first ``dn`` columns) and the
        value (last ``dv``). Head ``i`` of token ``t`` attends (causally, over its sequence's
        cached context) with keys ``[c_s @ w_k[i], k_pe_s]`` and values ``c_s @ w_v[i]``; softmax
        of the scores times ``scale``. Returns ``[T, h * dv]``.

        Two forms, equal up to rounding: ``expanded`` computes every key and value from the
        latents (prefill: the work is per query token anyway); ``absorbed`` moves ``w_k`` to
        the query side (``q_lat = q_nope @ w_k[i]^T``, scores ``q_lat . c + q_pe . k_pe``),
        attends over the latents themselves and applies ``w_v`` after the weighted sum, so a
        decode reads ``L + dr`` numbers per cached token and never expands a key or a value.
        """
        if form not in self.mla_forms:
            raise ValueError(f"mla_paged_attention form {form!r} is not one of {', '.join(self.mla_forms)}")
        num_heads, qk_dim = int(q.shape[1]), int(q.shape[2])
        width, rank = int(latent.shape[-1]), int(w_kv.shape[1])
        rope_dim = width - rank
        nope_dim = qk_dim - rope_dim
        v_dim = int(w_kv.shape[2]) - nope_dim
        paddle.scatter_(
            _cache_view(latent_cache, "_fd_slot_view", 2),
            meta.slot_mapping,
            latent.reshape([-1, 1, width]),
            overwrite=True,
        )
        state = meta.attn_state.get("paged_reference")
        if state is None:
            state = meta.attn_state["paged_reference"] = self._build_attention_state(meta, latent_cache.shape[1])
        batch, max_q, max_kv = state["batch"], state["max_q"], state["max_kv"]
        rows = self._kv_rows(state, 1)
        cached = paddle.index_select(_cache_view(latent_cache, "_fd_row_view", 1), rows, axis=0)
        cached = cached.reshape([batch, 1, max_kv, width])
        c, k_pe = paddle.split(cached, [rank, rope_dim], axis=-1)  # [B, 1, S, L], [B, 1, S, dr]
        w_k, w_v = paddle.split(w_kv, [nope_dim, v_dim], axis=-1)  # [h, L, dn], [h, L, dv]
        if state["pad_rows"] is not None:
            q = paddle.index_select(q, state["pad_rows"], axis=0)
        q = (q * scale).reshape([batch, max_q, num_heads, qk_dim]).transpose([0, 2, 1, 3])  # [B, h, Q, dk]
        mask = state["mask"]
        if mask is not None:
            mask = mask.reshape([batch, 1, max_q, max_kv])
        absorbed = form == "absorbed" or (form == "auto" and max_q == 1)
        if absorbed:
            q_nope, q_pe = paddle.split(q, [nope_dim, rope_dim], axis=-1)
            q_lat = paddle.matmul(q_nope, w_k, transpose_y=True)  # [B, h, Q, L]
            keys = (paddle.concat([q_lat, q_pe], axis=-1), cached)  # one dot product over L + dr
            values = c
        else:
            k_nope = paddle.matmul(c, w_k)  # [B, h, S, dn]
            k = paddle.concat([k_nope, paddle.expand(k_pe, [batch, num_heads, max_kv, rope_dim])], axis=-1)
            keys = (q, k)
            values = paddle.matmul(c, w_v)  # [B, h, S, dv]
        # Long prefills attend in query chunks so the score tensor stays bounded.
        chunk = max(1, self.max_score_elements // (batch * num_heads * max_kv))
        outs = []
        for start in range(0, max_q, chunk):
            stop = min(max_q, start + chunk)
            scores = paddle.matmul(keys[0][:, :, start:stop], keys[1], transpose_y=True)  # [B, h, q, S]
            if mask is not None:
                scores = scores + mask[:, :, start:stop]
            outs.append(paddle.matmul(F.softmax(scores, axis=-1), values))
        out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=2)
        if absorbed:
            out = paddle.matmul(out, w_v)  # [B, h, Q, L] -> [B, h, Q, dv]
        out = out.transpose([0, 2, 1, 3]).reshape([batch * max_q, num_heads * v_dim])
        if state["unpad_rows"] is not None:
            out = paddle.index_select(out, state["unpad_rows"], axis=0)
        return out

    @staticmethod
    def _kv_rows(state: dict, num_kv_heads: int) -> paddle.Tensor:
        """Rows of the ``[num_blocks * block_size * kvh, d]`` cache view, in ``[B, kvh, max_kv]`` order."""
        key = ("kv_rows", num_kv_heads)
        rows = state.get(key)
        if rows is None:
            table, block_size = state["block_table"], state["block_size"]
            slots = (table[:, :, None] * block_size + np.arange(block_size, dtype=np.int64)).reshape(table.shape[0], -1)
            heads = np.arange(num_kv_heads, dtype=np.int64)[None, :, None]
            rows = state[key] = paddle.to_tensor((slots[:, None, :] * num_kv_heads + heads).reshape(-1))
        return rows

    #: Upper bound on the elements of one attention score tensor (float32: 4 bytes each).
    max_score_elements: int = 64 * 1024 * 1024

    def _score_mask(self, state: dict, num_kv_heads: int, group: int, start: int, stop: int) -> paddle.Tensor:
        """The additive mask of query rows ``[start, stop)`` for scores ``[B, kvh, g, L, S]``.

        Unchunked, it is expanded once per step to the full score shape (same memory as one
        score tensor, which the activation estimate counts): Paddle's CPU add broadcasting
        ``[B, 1, 1, L, S]`` over the heads is ~4x slower than a same-shape add (512-token
        prefill: 21 vs 5 ms per layer), and every layer reuses the expanded mask.
        """
        mask = state["mask"]
        if (start, stop) != (0, state["max_q"]):
            return mask[:, :, :, start:stop]
        key = ("dense_mask", num_kv_heads, group)
        dense = state.get(key)
        if dense is None:
            dense = state[key] = paddle.tile(mask, [1, num_kv_heads, group, 1, 1])
        return dense

    @staticmethod
    def _prefill_attention(
        q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, mask: paddle.Tensor, weighted=None
    ) -> paddle.Tensor:
        """``q [B, L, kvh, g, d]`` (pre-scaled) over ``k``/``v [B, kvh, S, d]`` -> ``[B, L, h, d]``;
        ``weighted(scores, v)`` (default ``softmax(scores) @ v``) combines the values."""
        batch, length, num_kv_heads, group, head_dim = q.shape
        qg = q.transpose([0, 2, 3, 1, 4]).reshape([batch, num_kv_heads, group * length, head_dim])
        scores = paddle.matmul(qg, k, transpose_y=True)  # [B, kvh, g * L, S]
        max_kv = scores.shape[-1]
        scores = scores.reshape([batch, num_kv_heads, group, length, max_kv]) + mask
        scores = scores.reshape([batch, num_kv_heads, group * length, max_kv])
        if weighted is None:
            out = paddle.matmul(F.softmax(scores, axis=-1), v)
        else:
            out = weighted(scores, v)
        out = out.reshape([batch, num_kv_heads, group, length, head_dim])
        return out.transpose([0, 3, 1, 2, 4]).reshape([batch, length, num_kv_heads * group, head_dim])

    def _build_attention_state(self, meta, block_size: int, sliding_window: int | None = None) -> dict:
        """Host-side index math of one step, turned into device tensors once for all layers."""
        geo = PaddedBatch.from_meta(meta, block_size)
        state = {
            "batch": geo.batch,
            "max_q": geo.max_q,
            "max_kv": geo.max_kv,
            "block_ids": paddle.to_tensor(geo.block_table.reshape(-1)),
            "block_table": geo.block_table,
            "block_size": block_size,
            "pad_rows": None,
            "unpad_rows": None,
            "mask": None,
        }
        if geo.max_q == 1:
            windowed = bool(sliding_window) and int(geo.seq_lens.max()) > int(sliding_window)
            if geo.batch > 1 or int(geo.seq_lens[0]) != geo.max_kv or windowed:
                visible = geo.visible(sliding_window)[:, 0, :]  # [B, max_kv]
                state["mask"] = paddle.to_tensor(np.where(visible, 0.0, -np.inf).astype(np.float32)[:, None, None, :])
            return state
        mask = np.where(geo.visible(sliding_window), 0.0, -np.inf).astype(np.float32)  # [B, max_q, max_kv]
        state["mask"] = paddle.to_tensor(mask[:, None, None, :, :])
        if geo.batch > 1 or geo.max_q != int(geo.query_lens[0]):
            rows, unpad = geo.pad_rows()
            state["pad_rows"] = paddle.to_tensor(rows)
            state["unpad_rows"] = paddle.to_tensor(unpad)
        return state


_LOG2E = np.float32(1.4426950408889634)
_LN2 = np.float32(0.6931471805599453)


def _rounded_softmax_matmul(scores: paddle.Tensor, values: paddle.Tensor, rounded) -> paddle.Tensor:
    """``softmax(scores) @ values`` with the weights rounded by ``rounded`` before they multiply:
    w = rounded(exp(s - M)) with M = ln 2 * ceil(max s / ln 2) per row (float32), divided by the
    unrounded sum of exp(s - M). Rounding to a narrower float commutes with powers of two, so the
    weights do not depend on which multiple of ln 2 a kernel subtracted (its running maximum)."""
    top = paddle.max(scores, axis=-1, keepdim=True)
    lattice = paddle.ceil(top * float(_LOG2E)) * float(_LN2)
    lattice = paddle.where(paddle.isfinite(lattice), lattice, paddle.zeros_like(lattice))
    e = paddle.exp(scores - lattice)
    return paddle.matmul(rounded(e), values) / paddle.sum(e, axis=-1, keepdim=True)
