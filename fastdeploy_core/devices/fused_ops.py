"""Ops that take Paddle's fused kernels where the tensor's place registers them.

:class:`FusedOps` is the base chip plugins derive their ops table from. Each override asks
Paddle's kernel registry (:func:`fastdeploy_core.devices.kernels.has_kernel`) whether the
fused kernel exists for the input's place and dtype; if not, it computes the same result with
plain Paddle ops. Nothing here looks at a device name, so one class serves a CUDA build, an
XPU build, a custom-device build and the CPU build this project tests on.

It also offers the ``sdpa`` attention backend: paged attention through
``paddle.nn.functional.scaled_dot_product_attention`` (which dispatches to flash/memory-efficient
kernels where Paddle has them and to a math path elsewhere, and handles GQA natively).

Which kernel each op used on its last call is kept in :attr:`FusedOps.kernel_choices`, so the
conformance kit and ``fastdeploy env`` can say what really ran.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from fastdeploy_core.devices.kernels import dtype_name, has_kernel, place_backends
from fastdeploy_core.devices.padded_batch import PaddedBatch
from fastdeploy_core.devices.reference_ops import ReferenceOps

try:
    from paddle.incubate.nn.functional import fused_rms_norm as _fused_rms_norm
    from paddle.incubate.nn.functional import fused_rotary_position_embedding as _fused_rope
    from paddle.incubate.nn.functional import swiglu as _incubate_swiglu
except ImportError:  # pragma: no cover - a Paddle without the incubate fused API
    _fused_rms_norm = _fused_rope = _incubate_swiglu = None
# Paddle 3.3 moved swiglu to paddle.nn.functional (the incubate name is deprecated there).
_swiglu = getattr(F, "swiglu", None) or _incubate_swiglu

#: Python entry point -> the phi kernel it launches (what the registry is asked about).
RMS_NORM_KERNEL = "fused_rms_norm_quant"
ROPE_KERNEL = "fused_rotary_position_embedding"
SWIGLU_KERNEL = "swiglu"


def _where(tensor: paddle.Tensor) -> str:
    backends = place_backends(tensor.place)
    return f"{backends[0] if backends else tensor.place}/{dtype_name(tensor.dtype)}"


class FusedOps(ReferenceOps):
    """Reference ops with Paddle's fused kernels swapped in wherever the place has them.

    Subclasses (one per chip plugin) set :attr:`attention_backends` (first = default) and
    :attr:`expected_kernels`, the fused kernels the vendor expects Paddle to provide on its
    chip; the conformance kit checks that list on real hardware.
    """

    attention_backends: tuple[str, ...] = ("sdpa", "paged_reference")
    expected_kernels: tuple[str, ...] = ()

    def __init__(self, attention_backend: str | None = None):
        super().__init__(attention_backend=attention_backend or self.attention_backends[0])
        #: op name -> "fused <kernel>" or "reference (no <kernel> for <place>/<dtype>)"
        self.kernel_choices: dict[str, str] = {}
        self._cast_caches: dict[tuple, tuple] = {}

    def _use(self, op: str, kernel: str, fn, tensor: paddle.Tensor) -> bool:
        if fn is not None and has_kernel(kernel, tensor):
            self.kernel_choices[op] = f"fused {kernel}"
            return True
        self.kernel_choices[op] = f"reference (no {kernel} kernel for {_where(tensor)})"
        return False

    # ---- norms ------------------------------------------------------------------------------
    def rms_norm(self, x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
        if self._use("rms_norm", RMS_NORM_KERNEL, _fused_rms_norm, x):
            return _fused_rms_norm(x, weight, None, eps, begin_norm_axis=x.ndim - 1)[0]
        return _plain_rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if residual is None:
            return self.rms_norm(x, weight, eps), x
        if self._use("add_rms_norm", RMS_NORM_KERNEL, _fused_rms_norm, x):
            normed, summed = _fused_rms_norm(x, weight, None, eps, begin_norm_axis=x.ndim - 1, residual=residual)
            return normed, summed
        summed = x + residual
        return _plain_rms_norm(summed, weight, eps), summed

    # ---- activation -------------------------------------------------------------------------
    def silu_and_mul(self, x: paddle.Tensor) -> paddle.Tensor:
        if self._use("silu_and_mul", SWIGLU_KERNEL, _swiglu, x):
            return _swiglu(x)
        gate, up = paddle.chunk(x, 2, axis=-1)
        return F.silu(gate) * up

    # ---- rotary -------------------------------------------------------------------------------
    def rotary_embedding(self, positions, q, k, cos_sin_cache):
        """``fused_rotary_position_embedding`` in rotate-half style (``use_neox_rotary_style=False``).

        The cache row of a position holds ``cos`` and the signed ``sin`` ``[-s, s]`` (see
        :meth:`ReferenceOps.rotary_embedding`); the kernel wants the plain ``[s, s]``, per token,
        shaped ``[1, T, 1, d]``, with ``q``/``k`` as ``[1, T, heads, d]``. ``q`` and ``k`` are
        rotated in two calls because their head counts differ under GQA.
        """
        if not self._use("rotary_embedding", ROPE_KERNEL, _fused_rope, q):
            # The model's cache is float32; in a half dtype the reference formula needs it cast.
            return super().rotary_embedding(positions, q, k, self._cache_as(cos_sin_cache, q.dtype))
        rows = paddle.index_select(cos_sin_cache, positions, axis=0)  # [T, 2, d]
        half = q.shape[-1] // 2
        cos = rows[:, 0, :].astype(q.dtype).unsqueeze([0, 2])  # [1, T, 1, d]
        sin_half = rows[:, 1, half:]
        sin = paddle.concat([sin_half, sin_half], axis=-1).astype(q.dtype).unsqueeze([0, 2])
        q_out = _fused_rope(q.unsqueeze(0), sin=sin, cos=cos, use_neox_rotary_style=False)[0].squeeze(0)
        k_out = None
        if k is not None:
            k_out = _fused_rope(k.unsqueeze(0), sin=sin, cos=cos, use_neox_rotary_style=False)[0].squeeze(0)
        return q_out, k_out

    def _cache_as(self, cache: paddle.Tensor, dtype) -> paddle.Tensor:
        if cache.dtype == dtype:
            return cache
        key = (id(cache), str(dtype))
        cast = self._cast_caches.get(key)
        if cast is None or cast[0] is not cache:
            cast = (cache, cache.astype(dtype))
            self._cast_caches[key] = cast
        return cast[1]

    # ---- attention ----------------------------------------------------------------------------
    def paged_attention(self, q, k_cache, v_cache, meta, scale: float, sliding_window: int | None = None):
        if self.attention_backend != "sdpa" or sliding_window:
            return super().paged_attention(q, k_cache, v_cache, meta, scale, sliding_window)
        self.kernel_choices["paged_attention"] = "scaled_dot_product_attention"
        state = meta.attn_state.get("sdpa")
        if state is None:
            state = _sdpa_state(meta, k_cache.shape[1])
            meta.attn_state["sdpa"] = state
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        batch, max_q, max_kv = state["batch"], state["max_q"], state["max_kv"]
        k = paddle.index_select(k_cache, state["block_ids"], axis=0).reshape([batch, max_kv, num_kv_heads, head_dim])
        v = paddle.index_select(v_cache, state["block_ids"], axis=0).reshape([batch, max_kv, num_kv_heads, head_dim])
        if k.dtype != q.dtype:
            # A bfloat16 cache under float32 activations: widened as read, and the scaled queries
            # rounded to bfloat16 as the reference's formula does (its softmax weights are rounded
            # too, which this fused call cannot do: within the conformance kit's bound for that).
            q = (q * scale).astype(k.dtype).astype(q.dtype)
            scale = 1.0
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        if state["pad_rows"] is not None:
            q = paddle.index_select(q, state["pad_rows"], axis=0)
        q = q.reshape([batch, max_q, num_heads, head_dim])
        mask = state["mask"]
        if mask is not None and mask.dtype != q.dtype:
            mask = mask.astype(q.dtype)
            state["mask"] = mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, training=False, scale=scale)
        out = out.reshape([batch * max_q, num_heads, head_dim])
        if state["unpad_rows"] is not None:
            out = paddle.index_select(out, state["unpad_rows"], axis=0)
        return out


def _plain_rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    variance = paddle.mean(x.astype("float32") ** 2, axis=-1, keepdim=True)
    return (x.astype("float32") * paddle.rsqrt(variance + eps)).astype(x.dtype) * weight


def _sdpa_state(meta, block_size: int) -> dict:
    """Index tensors of one step for the sdpa backend (built once, shared by every layer).

    Queries are padded to ``[B, max_q]``; keys are whole blocks gathered from the block tables,
    ``[B, max_kv]``; the additive mask hides future positions and the padding beyond each
    sequence's length. Padded query rows are dropped again after attention.
    """
    geo = PaddedBatch.from_meta(meta, block_size)
    state = {
        "batch": geo.batch,
        "max_q": geo.max_q,
        "max_kv": geo.max_kv,
        "block_ids": paddle.to_tensor(geo.block_table.reshape(-1)),
        "pad_rows": None,
        "unpad_rows": None,
        "mask": None,
    }
    visible = geo.visible()
    if not visible.all():
        mask = np.where(visible, 0.0, -np.inf).astype(np.float32)[:, None, :, :]  # [B, 1, max_q, max_kv]
        state["mask"] = paddle.to_tensor(mask)
    if geo.batch > 1 and not np.all(geo.query_lens == geo.max_q):
        rows, unpad = geo.pad_rows()
        state["pad_rows"] = paddle.to_tensor(rows)
        state["unpad_rows"] = paddle.to_tensor(unpad)
    return state
