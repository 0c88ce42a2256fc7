"""The cpu device's ops table: the C++ kernels of ``csrc/``, or the reference formulas without them.

:class:`CpuOps` is :class:`ReferenceOps` with linear layers (float32 and one op per
quantization method), the attention block and RMSNorm on the kernels. Each quantized op takes
the storage arguments of its quantizer's ``op_args`` and computes exactly its ``reference_op``;
when the kernels cannot be built (see :mod:`fastdeploy_core.builtin.cpu.kernels`) every op runs
the reference formula and weights keep the plain layout.
"""

from __future__ import annotations

import os

import numpy as np
import paddle
from paddle import _C_ops

from fastdeploy_core.builtin.cpu.kernels import amx_state, has_avx512_bf16, has_int8_dot, load_kernels
from fastdeploy_core.builtin.cpu.layout import (
    PACK_COLUMNS,
    QUAD_ROWS,
    VNNI_CHUNK,
    pack_bf16_pair_tiles,
    pack_column_tiles,
    pack_expert_tiles,
    pack_int4_vnni_tiles,
    pack_int8_quad_tiles,
    unpack_column_tiles,
)
from fastdeploy_core.devices.reference_ops import CapturedGraph, ReferenceOps
from fastdeploy_core.quantization.base import add_bias
from fastdeploy_core.quantization.fp8 import fp8_linear_reference
from fastdeploy_core.quantization.weight_only import int4_linear_reference, int8_linear_reference

_run = _C_ops._run_custom_op  # the op must be registered: load_kernels() ran first (see _ready)


def _kernel_message(exc: Exception) -> str:
    """A kernel's PD_CHECK message without the source location Paddle appends."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip() and not line.strip().startswith("[/")]
    return " ".join(lines)[:500] or type(exc).__name__


class CpuQuantOps:
    """Quantized linear ops backed by ``csrc/weight_only_gemm.cc`` (mixed into an ops table).

    A decode step makes ~120 of these calls, so they go straight to ``_C_ops._run_custom_op``
    (the generated Python wrapper adds a mode check and list handling to every call).
    """

    _kernels_checked = False
    _have_kernels = False

    def _ready(self) -> bool:
        if not self._kernels_checked:
            self._have_kernels = load_kernels() is not None
            self._kernels_checked = True
        return self._have_kernels

    def prepare_quantization(self) -> None:
        """Build or load the kernels (called while a quantized model is created)."""
        self._ready()

    def wint8_linear(self, x, weight, scale, group_size: int, bias=None) -> paddle.Tensor:
        if not (self._have_kernels or self._ready()):
            return int8_linear_reference(x, weight, scale, group_size, bias)
        if weight.ndim == 4:  # prepare_wint8_weights' layout: integer products, 16-bit activations
            return add_bias(_run("fd_w8a8_linear", x, weight, scale, 2, self.int8_tiles_path)[0], bias)
        return add_bias(_run("fd_int8_linear", x, weight, scale, group_size, False)[0], bias)

    def w8a8_linear(self, x, weight, scale, group_size: int, bias=None) -> paddle.Tensor:
        if not (self._have_kernels or self._ready()):
            return int8_linear_reference(x, weight, scale, group_size, bias, act_int8=True)
        if weight.ndim == 4:  # prepare_w8a8_weights' layout: integer products
            return add_bias(_run("fd_w8a8_linear", x, weight, scale, 1, self.int8_tiles_path)[0], bias)
        return add_bias(_run("fd_int8_linear", x, weight, scale, group_size, True)[0], bias)

    def wint8_linear_silu_and_mul(self, x, weight, scale, group_size: int, bias=None) -> paddle.Tensor:
        """``silu_and_mul(wint8_linear(...))`` (a merged gate/up projection): see :meth:`_int8_fused`."""
        return self._int8_fused("silu", 2, x, weight, scale, group_size, bias)

    def w8a8_linear_silu_and_mul(self, x, weight, scale, group_size: int, bias=None) -> paddle.Tensor:
        """``silu_and_mul(w8a8_linear(...))``: see :meth:`_int8_fused`."""
        return self._int8_fused("silu", 1, x, weight, scale, group_size, bias)

    def wint8_linear_argmax(self, x, weight, scale, group_size: int, bias=None) -> np.ndarray:
        """``argmax_rows(wint8_linear(...))`` (a head's greedy tokens): see :meth:`_int8_fused`."""
        return self._int8_fused("argmax", 2, x, weight, scale, group_size, bias)

    def w8a8_linear_argmax(self, x, weight, scale, group_size: int, bias=None) -> np.ndarray:
        """``argmax_rows(w8a8_linear(...))``: see :meth:`_int8_fused`."""
        return self._int8_fused("argmax", 1, x, weight, scale, group_size, bias)

    def _int8_fused(self, what: str, pieces: int, x, weight, scale, group_size: int, bias):
        """``silu_and_mul`` (``what="silu"``) or ``argmax_rows`` (``"argmax"``) of a w8a8
        (``pieces=1``) or wint8 (2) layer's output: one kernel, ``fd_w8a8_linear_silu`` /
        ``fd_w8a8_linear_argmax``, where ``fd_w8a8_linear``'s auto path takes AMX-INT8 tiles for
        the step (16 rows or more, tiles granted and checked; the same bits: exact integer sums,
        then fd_silu_mul's formula or fd_argmax's rule); else the layer's op and then the other."""
        silu = what == "silu"
        if (bias is None and weight.ndim == 4 and x.dtype == paddle.float32 and self.int8_tiles_path == 0
                and (x.ndim == 2 or (silu and x.ndim >= 1)) and int(np.prod(x.shape[:-1])) >= 16
                and not (silu and weight.shape[0] % 2) and self._tiles_in_use("fd_w8a8_amx_state")):
            out = _run("fd_w8a8_linear_silu" if silu else "fd_w8a8_linear_argmax", x, weight, scale, pieces, 2)[0]
            return out if silu else out.numpy()
        linear = self.w8a8_linear if pieces == 1 else self.wint8_linear
        y = linear(x, weight, scale, group_size, bias)
        return self.silu_and_mul(y) if silu else self.argmax_rows(y)

    def _tiles_in_use(self, state_op: str) -> bool:
        """Whether the kernel of ``state_op`` (``kernels.AMX_STATE_OPS``) multiplies in AMX tiles in
        this process (asked once per table); False without the kernels."""
        states = self.__dict__.setdefault("_tile_states", {})
        if state_op not in states:
            states[state_op] = (self._have_kernels or self._ready()) and amx_state(state_op) == 1
        return states[state_op]

    #: ``w8a8`` layers multiply int8 by int8 (``fd_w8a8_linear``) when the kernels have integer dot
    #: products here (``has_int8_dot``); ``FD_W8A8_INT_DOT=0`` keeps the float32 products of
    #: ``fd_int8_linear``.
    w8a8_int_dot = has_int8_dot() and os.environ.get("FD_W8A8_INT_DOT", "1") not in ("0", "")
    #: ``wint8`` layers likewise, their activations as two int8 pieces (``FD_WINT8_INT_DOT=0``: the
    #: float32 loop of ``fd_int8_linear``, which widens each weight and multiplies in float32).
    wint8_int_dot = has_int8_dot() and os.environ.get("FD_WINT8_INT_DOT", "1") not in ("0", "")
    #: ``fd_w8a8_linear``'s path: 0 lets the kernel choose (AMX-INT8 tiles for 16 rows or more
    #: where the CPU has them, else VNNI / AVX2), 1 never tiles (``FD_INT8_AMX=0``). Both give
    #: the same bits (exact integer sums).
    int8_tiles_path = 1 if os.environ.get("FD_INT8_AMX", "1") in ("0", "") else 0

    def prepare_w8a8_weights(self, weight: paddle.Tensor, scale: paddle.Tensor):
        """A ``w8a8`` layer's ``(weight, scale)`` for ``fd_w8a8_linear`` (:meth:`int8_quads`), else ``None``."""
        return self.int8_quads(weight, scale) if self.w8a8_int_dot else None

    def prepare_wint8_weights(self, weight: paddle.Tensor, scale: paddle.Tensor):
        """A ``wint8`` layer's ``(weight, scale)`` for ``fd_w8a8_linear`` with two pieces, else ``None``.

        On AVX-512 VNNI a step of many rows then multiplies 4 byte pairs per lane and instruction,
        two instructions per 4 products (the high and the low piece of each 16-bit activation),
        where the float32 loop multiplies one product per lane and instruction after widening the
        weight: about twice the rate, bfloat16's. Each row is rounded by itself, so outputs do not
        depend on the batch; they differ from the float32 formula by the activations' rounding
        (at most 1/65278 of the row's largest value per element).
        """
        return self.int8_quads(weight, scale) if self.wint8_int_dot else None

    def int8_quads(self, weight: paddle.Tensor, scale: paddle.Tensor):
        """Per-channel int8 codes ``[K, N]`` and scales ``[1, N]`` as ``fd_w8a8_linear`` reads them:
        the codes ``[N / 32, K / 4, 32, 4]`` (:func:`pack_int8_quad_tiles`), the scales as they are.
        ``None`` (the layer keeps :meth:`prepare_linear_weight`'s layout and the float32 products)
        without kernels, with group scales, when ``K % 4`` or ``N % 32``
        is not 0, or when a code is -128 (the flip to unsigned bytes needs [-127, 127]).
        """
        if (
            weight.ndim != 2
            or weight.dtype != paddle.int8
            or scale.ndim != 2
            or int(scale.shape[0]) != 1
            or weight.shape[1] % PACK_COLUMNS != 0
            or weight.shape[0] % QUAD_ROWS != 0
            or not (self._have_kernels or self._ready())
        ):
            return None
        if int(weight.numpy().min()) < -127:
            return None
        return pack_int8_quad_tiles(weight), scale.astype("float32")

    def wint4_linear(self, x, weight, scale, offset, group_size: int, bias=None) -> paddle.Tensor:
        if not (self._have_kernels or self._ready()):
            return int4_linear_reference(x, weight, scale, offset, group_size, bias)
        return add_bias(_run("fd_int4_linear", x, weight, scale, offset, group_size, False)[0], bias)

    def w4a8_linear(self, x, weight, scale, offset, group_size: int, bias=None) -> paddle.Tensor:
        if not (self._have_kernels or self._ready()):
            return int4_linear_reference(x, weight, scale, offset, group_size, bias, act_int8=True)
        return add_bias(_run("fd_int4_linear", x, weight, scale, offset, group_size, True)[0], bias)

    def block_wise_fp8_linear(self, x, weight, scale, block_rows: int, bias=None) -> paddle.Tensor:
        if not (self._have_kernels or self._ready()):
            return fp8_linear_reference(x, weight, scale, block_rows, bias)
        return add_bias(_run("fd_fp8_linear", x, weight, scale, block_rows)[0], bias)


class CpuOps(CpuQuantOps, ReferenceOps):
    """The cpu device's ops table: plain-Paddle reference ops plus the C++ kernels.

    Linear weights (float32 and quantized storage) are stored packed, ``[out / 32, rows, 32]``
    (each 32-column tile one contiguous stream), and multiplied by the kernels: on this machine a batch-1 decode
    reads them at ~25-40 GB/s instead of MKL's ~15 (rows of a row-major ``[in, out]`` weight
    are 128-byte pieces 4*out bytes apart, which the hardware prefetcher does not follow), and
    batch 16 runs 8-row register tiles. Weights whose width is not a multiple of 32 stay
    ``[in, out]`` on Paddle's matmul, as does everything when the kernels cannot build.
    """

    def prepare_linear_weight(self, weight: paddle.Tensor) -> paddle.Tensor | None:
        """Column tiles ``[out / 32, rows, 32]``; a bfloat16 weight (``--dtype bfloat16``) the
        k-pair tiles ``[out / 32, in / 2, 32, 2]`` of ``fd_bf16_linear`` (needs an even ``in``)."""
        if weight.ndim != 2 or weight.shape[1] % PACK_COLUMNS != 0 or not (self._have_kernels or self._ready()):
            return None
        if weight.dtype == paddle.bfloat16:
            return pack_bf16_pair_tiles(weight) if weight.shape[0] % 2 == 0 else None
        return pack_column_tiles(weight)

    #: ``fd_bf16_linear``'s path: 0 lets the kernel choose by CPU feature (AMX tiles, else
    #: ``vdpbf16ps`` with AVX-512 BF16, else widening), 1 widens the weights to float32 in the
    #: tile loop (``FD_BF16_DOT=0``), 2 ``vdpbf16ps`` without tiles (``FD_BF16_AMX=0``). Widening
    #: and ``vdpbf16ps`` give the same bits, tiles sum in their own order; tests pass the path to
    #: :meth:`bf16_linear` instead. The attention over a bfloat16 KV cache takes the same path
    #: number (its AMX tiles, for prompt chunks, have their own self-check: ``fd_attention_amx_state``).
    bf16_path = (
        1 if os.environ.get("FD_BF16_DOT", "1") in ("0", "")
        else 2 if os.environ.get("FD_BF16_AMX", "1") in ("0", "") and has_avx512_bf16()
        else 0
    )

    def bf16_linear(self, x, weight, bias=None, path: int | None = None) -> paddle.Tensor:
        """``fd_bf16_linear`` on a weight :meth:`prepare_linear_weight` packed (``path``: 0 the
        CPU's best, 1 widen, 2 ``vdpbf16ps``, 3 AMX tiles, 4 the tile loop on a software model of
        the instructions; ``None`` = :attr:`bf16_path`), else the reference
        formula; see :meth:`ReferenceOps.bf16_linear`."""
        if weight.ndim != 4 or x.dtype not in (paddle.float32, paddle.bfloat16) or not (self._have_kernels or self._ready()):
            return ReferenceOps.bf16_linear(self, x, weight, bias)
        return add_bias(_run("fd_bf16_linear", x, weight, self.bf16_path if path is None else int(path))[0], bias)

    def bf16_linear_silu_and_mul(self, x, weight, bias=None) -> paddle.Tensor:
        """``silu_and_mul(bf16_linear(x, weight, bias))`` (a merged gate/up projection): in one
        kernel, ``fd_bf16_linear_silu``, when this process's bf16 linears multiply in AMX tiles
        (their product never goes through memory), else the two ops. The kernel returns the
        SwiGLU rounded to bfloat16, the two ops' bits rounded as :meth:`bf16_linear` rounds its
        input: the down projection after it (a bf16 linear) computes the same either way."""
        if weight.ndim == 4 and weight.shape[0] % 2 == 0 and self._bf16_fuses(x, bias):
            return _run("fd_bf16_linear_silu", x, weight, 3)[0]
        return self.silu_and_mul(self.bf16_linear(x, weight, bias))

    def bf16_linear_argmax(self, x, weight, bias=None) -> np.ndarray:
        """``argmax_rows(bf16_linear(x, weight, bias))`` (a bfloat16 LM head's greedy tokens): in
        one kernel, ``fd_bf16_linear_argmax``, when this process's bf16 linears multiply in AMX
        tiles (the logits never go through memory; the same tokens), else the two ops."""
        if weight.ndim == 4 and x.ndim == 2 and self._bf16_fuses(x, bias):
            return _run("fd_bf16_linear_argmax", x, weight, 3)[0].numpy()
        return self.argmax_rows(self.bf16_linear(x, weight, bias))

    def _bf16_fuses(self, x, bias) -> bool:
        """Whether a fused bf16 kernel takes ``x``: no bias, float32 (or bfloat16) rows, and ``fd_bf16_linear``'s
        auto path multiplying in AMX tiles in this process."""
        return (bias is None and x.dtype in (paddle.float32, paddle.bfloat16) and self.bf16_path == 0
                and self._tiles_in_use("fd_bf16_amx_state"))

    #: int4 layers (``wint4``, ``w4a8``) take the VNNI layout when the kernels have integer dot
    #: products on this CPU (AVX-512 VNNI, or AVX2: ``has_int8_dot``); ``FD_INT4_VNNI=0`` keeps
    #: ``[N / 32, K / 2, 32]`` and the float-FMA loop.
    int4_vnni_layout = has_int8_dot() and os.environ.get("FD_INT4_VNNI", "1") not in ("0", "")

    def prepare_int4_weights(self, weight: paddle.Tensor, scale: paddle.Tensor, offset: paddle.Tensor):
        """An int4 layer's ``(weight, scale, offset)`` for ``fd_int4_linear``'s ``vpdpbusd`` path, else ``None``.

        The codes ``uint8 [K / 2, N]`` become ``[N / 32, K / 8, 32, 4]`` (:func:`pack_int4_vnni_tiles`),
        the scales and offsets ``[N / 32, G, 32]`` column tiles (each tile's scales one contiguous
        stream, as its codes), float16 when both convert exactly (GGUF Q4_0 / Q4_1 store ``d`` and
        ``m`` as float16: a decode step then reads 20 instead of 24 bytes per 32 weights).
        ``None`` (the layer keeps :meth:`prepare_linear_weight`'s layout) without integer dot products, kernels,
        or when ``K % 8`` or ``N % 32`` is not 0.
        """
        if (
            not self.int4_vnni_layout
            or weight.ndim != 2
            or weight.dtype != paddle.uint8
            or scale.ndim != 2
            or offset.ndim != 2
            or weight.shape[1] % PACK_COLUMNS != 0
            or (2 * int(weight.shape[0])) % VNNI_CHUNK != 0
            or not (self._have_kernels or self._ready())
        ):
            return None
        s, o = scale.numpy(), offset.numpy()
        with np.errstate(over="ignore"):
            s16, o16 = s.astype(np.float16), o.astype(np.float16)
        if np.array_equal(s16.astype(np.float32), s) and np.array_equal(o16.astype(np.float32), o):
            scale, offset = paddle.to_tensor(s16), paddle.to_tensor(o16)
        return pack_int4_vnni_tiles(weight), pack_column_tiles(scale), pack_column_tiles(offset)

    def unprepare_linear_weight(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """Column tiles (rank 3), the int4 VNNI and int8 quad layouts (rank 4) back to ``[rows, out]``."""
        return unpack_column_tiles(tensor)

    def linear(self, x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None = None) -> paddle.Tensor:
        if weight.ndim == 3:  # packed by prepare_linear_weight
            return add_bias(_run("fd_f32_linear", x, weight)[0], bias)
        return ReferenceOps.linear(self, x, weight, bias)

    def linear_silu_and_mul(self, x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None = None) -> paddle.Tensor:
        """``silu_and_mul(linear(x, weight, bias))`` (a merged float32 gate/up projection): one
        kernel, ``fd_f32_linear_silu``, when the weight is packed with whole-tile halves and there
        is no bias (the product never goes through memory; the same bits as the two ops), else
        the two ops."""
        if weight.ndim == 3 and weight.shape[0] % 2 == 0 and bias is None and x.dtype == paddle.float32:
            return _run("fd_f32_linear_silu", x, weight)[0]
        return ReferenceOps.linear_silu_and_mul(self, x, weight, bias)

    def embedding(self, ids: paddle.Tensor, weight: paddle.Tensor) -> paddle.Tensor:
        if not (self._have_kernels or self._ready()) or weight.dtype != paddle.float32 or ids.dtype != paddle.int64:
            return ReferenceOps.embedding(self, ids, weight)
        return _run("fd_embedding", ids.reshape([-1]), weight)[0]

    def int8_embedding(self, ids, weight, scale, group_size: int) -> paddle.Tensor:
        if not (self._have_kernels or self._ready()) or ids.dtype != paddle.int64:
            return ReferenceOps.int8_embedding(self, ids, weight, scale, group_size)
        return _run("fd_int8_embedding", ids.reshape([-1]), weight, scale, int(group_size))[0]

    def capture_graph(self, forward, static_tensors: list, previous: CapturedGraph | None = None) -> CapturedGraph:
        """Record the forward's kernel calls (``csrc/graph.h``): replaying them skips Paddle's
        dispatch and the Python layers, ~8 us per op, ~2 ms of a batch-1 step. The recording is
        refused (``ok`` false, the reason given) when any op of the forward is not one of these
        kernels, since a replay would skip it. A first recording keeps only the memory plan of
        its activations (``planned`` false, not replayable); recorded again with it as
        ``previous``, the activations go to one arena laid out by that plan (``arena_bytes``)."""
        if not (self._have_kernels or self._ready()):
            return ReferenceOps.capture_graph(self, forward, static_tensors, previous)
        plan = previous.state if previous is not None and not previous.planned else None
        _run("fd_graph_begin", list(static_tensors), int(plan.numpy()[0]) if plan is not None else 0)
        try:
            output = forward()
        except BaseException:
            _run("fd_graph_abort", paddle.zeros([1], dtype="int64"))
            raise
        try:
            handle = _run("fd_graph_end", output)[0]
        except Exception as exc:  # noqa: BLE001 - the recording is refused; the output stands
            return CapturedGraph(output, None, _kernel_message(exc))
        return CapturedGraph(
            output,
            lambda: _run("fd_graph_replay", handle),
            release_fn=lambda: _run("fd_graph_release", handle),
            planned=plan is not None,
            arena_bytes=int(_run("fd_graph_arena_bytes", handle)[0].numpy()[0]),
            state=handle,
        )

    def rms_norm(self, x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
        if not (self._have_kernels or self._ready()) or x.dtype != paddle.float32:
            return ReferenceOps.rms_norm(self, x, weight, eps)
        return _run("fd_rms_norm", x, weight, eps)[0]

    def add_rms_norm(self, x, residual, weight, eps: float):
        """``fd_add_rms_norm`` (one pass, no OpenMP team per call); see :meth:`ReferenceOps.add_rms_norm`."""
        if residual is None:
            return self.rms_norm(x, weight, eps), x
        if not (self._have_kernels or self._ready()) or x.dtype != paddle.float32:
            return ReferenceOps.add_rms_norm(self, x, residual, weight, eps)
        normed, summed = _run("fd_add_rms_norm", x, residual, weight, eps)
        return normed, summed

    def rms_norm_bf16_rows(self, x, residual, weight, eps: float):
        """:meth:`add_rms_norm` (``residual`` may be ``None``) for a bfloat16 linear layer after
        it: the normed rows rounded to bfloat16 in the norm's own pass (``fd_add_rms_norm_bf16``,
        ``fd_rms_norm_bf16``), as :meth:`bf16_linear` rounds its float32 input, so the linear
        computes the same bits from them; float32 rows where the kernels cannot run."""
        if not (self._have_kernels or self._ready()) or x.dtype != paddle.float32:
            return self.add_rms_norm(x, residual, weight, eps)
        if residual is None:
            return _run("fd_rms_norm_bf16", x, weight, eps)[0], x
        normed, summed = _run("fd_add_rms_norm_bf16", x, residual, weight, eps)
        return normed, summed

    def silu_and_mul(self, x: paddle.Tensor) -> paddle.Tensor:
        if not (self._have_kernels or self._ready()) or x.dtype != paddle.float32:
            return ReferenceOps.silu_and_mul(self, x)
        return _run("fd_silu_mul", x)[0]

    def argmax_rows(self, logits: paddle.Tensor) -> np.ndarray:
        """``fd_argmax``: one vector pass per row (Paddle's argmax: 2.7 ms for 64 x 49152 here)."""
        if not (self._have_kernels or self._ready()) or logits.dtype != paddle.float32 or logits.ndim != 2:
            return ReferenceOps.argmax_rows(self, logits)
        return _run("fd_argmax", logits)[0].numpy()

    #: ``FD_GREEDY_HEAD=0``: greedy steps compute the float32 logits (for comparisons).
    greedy_head_screen = os.environ.get("FD_GREEDY_HEAD", "1") not in ("0", "")
    #: Widest hidden size whose int8 dot products fit the kernel's int32 accumulators.
    greedy_head_max_hidden = 65536

    def prepare_greedy_head(self, weight: paddle.Tensor) -> tuple | None:
        """``(screen, meta)`` of ``fd_greedy_head_prepare`` for a packed float32 head, else ``None``.

        The screen is an int8 copy of the head (a quarter of its bytes) read with integer dot
        products, so it needs AVX-512 VNNI or AVX2 (``has_int8_dot``); a head with NaN or inf weights keeps the logits path (the
        screen's error bound assumes finite weights).
        """
        if (
            not self.greedy_head_screen
            or weight.ndim != 3
            or weight.dtype != paddle.float32
            or int(weight.shape[1]) > self.greedy_head_max_hidden
            or not has_int8_dot()
            or not (self._have_kernels or self._ready())
            or not bool(paddle.isfinite(weight).all())
        ):
            return None
        screen, meta = _run("fd_greedy_head_prepare", weight)
        return screen, meta

    def greedy_lm_head(self, hidden, weight, bias=None, prepared=None) -> np.ndarray:
        """``fd_greedy_head``: the int8 screen bounds every logit, only the tiles that may hold the
        argmax are computed in float32 (with ``fd_f32_linear``'s loop, so the tokens are
        ``argmax_rows(linear(...))``'s). SmolLM2's head: batch 1 ~0.9 instead of ~4.3 ms, batch 64
        ~15 instead of ~36 (benchmarks/greedy_head.md)."""
        if (
            prepared is None
            or bias is not None
            or weight.ndim != 3
            or hidden.ndim != 2
            or hidden.dtype != paddle.float32
            or not (self._have_kernels or self._ready())
        ):
            return ReferenceOps.greedy_lm_head(self, hidden, weight, bias, prepared)
        return _run("fd_greedy_head", hidden, weight, *prepared)[0].numpy()

    @property
    def ragged_attention(self) -> bool:
        """With the kernels, attention costs what each sequence's own query rows cost, however a
        step mixes prompt chunks and decodes (the scheduler then mixes them; see
        :func:`fastdeploy_core.engine.engine_core.mixes_prefill_and_decode`)."""
        return self._have_kernels or self._ready()

    def rope_paged_attention(
        self,
        qkv,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        meta,
        num_heads: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> paddle.Tensor:
        """``fd_rope_paged_attention`` (``fd_rope_write_kv`` then ``fd_paged_attention``): 1 op per
        layer instead of ~20, ragged (no padding of a step's sequences to its longest query run),
        tiled with an online softmax so its cost stays proportional to the (query, key) pairs at
        any context: at SmolLM2's shape one layer of a whole 8,000-token prompt takes ~1.1 s of
        CPU where the untiled kernel took ~9.3 s, a 512-token prompt ~6.6 ms (was ~10); see
        ``benchmarks/long_context.md``. A bfloat16 cache (``--kv-cache-dtype bfloat16``) is
        written rounded (nearest, ties to even) and widened back to float32 tile by tile as it is
        read; the queries and all the attention arithmetic stay float32."""
        if (
            not (self._have_kernels or self._ready())
            or not isinstance(k_cache, paddle.Tensor)
            or k_cache.dtype not in (paddle.float32, paddle.bfloat16)
            or qkv.dtype != paddle.float32
            or qkv.ndim != 2
        ):
            return ReferenceOps.rope_paged_attention(
                self, qkv, positions, cos_sin_cache, k_cache, v_cache, meta, num_heads, num_kv_heads, scale, sliding_window
            )
        return _run(
            "fd_rope_paged_attention",
            qkv,
            positions,
            cos_sin_cache,
            k_cache,
            v_cache,
            meta.slot_mapping,
            meta.tensor("query_start_loc"),
            meta.tensor("seq_lens"),
            meta.tensor("block_tables"),
            num_heads,
            num_kv_heads,
            scale,
            int(sliding_window or 0),
            self.bf16_path,
        )[0]

    def prepare_expert_weight(self, weight: paddle.Tensor) -> paddle.Tensor | None:
        """Stacked float32 experts ``[E, rows, N]`` as ``[E, N / 32, rows, 32]`` (each expert's
        weight in :meth:`prepare_linear_weight`'s column tiles, :func:`pack_expert_tiles`) for
        ``fd_fused_moe``; ``None`` (plain, which the kernel also reads) when ``N % 32`` is not 0
        or without the kernels. :meth:`unprepare_linear_weight` gives ``[E, rows, N]`` back."""
        if (
            weight.ndim != 3
            or weight.dtype != paddle.float32
            or weight.shape[2] % PACK_COLUMNS != 0
            or not (self._have_kernels or self._ready())
        ):
            return None
        return pack_expert_tiles(weight)

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids) -> paddle.Tensor:
        """``fd_fused_moe`` (``csrc/moe.cc``): the (token, choice) rows grouped by expert in C++ and
        each used expert's rows multiplied at once with ``fd_f32_linear``'s tile loop, one op per
        layer instead of ~4 Paddle ops per used expert plus a host-side count. Takes the weights
        plain or as :meth:`prepare_expert_weight` left them; see :meth:`ReferenceOps.fused_moe`."""
        if (
            not (self._have_kernels or self._ready())
            or x.dtype != paddle.float32
            or x.ndim != 2
            or w13.dtype != paddle.float32
            or w2.dtype != paddle.float32
        ):
            if w13.ndim == 4 or w2.ndim == 4:
                w13, w2 = self.unprepare_linear_weight(w13), self.unprepare_linear_weight(w2)
            return ReferenceOps.fused_moe(self, x, w13, w2, topk_weights, topk_ids)
        if topk_weights.dtype != paddle.float32:
            topk_weights = topk_weights.astype("float32")
        if topk_ids.dtype != paddle.int64:
            topk_ids = topk_ids.astype("int64")
        return _run("fd_fused_moe", x, w13, w2, topk_weights, topk_ids)[0]

    def mla_paged_attention(self, q, latent, latent_cache, meta, w_kv, scale: float, form: str = "auto"):
        """``fd_mla_absorbed_attention`` (``csrc/mla_attention.cc``) for the absorbed form (``auto``
        on a decode-only step, or ``absorbed`` asked for): the latent rows written and attended in
        C++, one op per layer instead of ~15 Paddle ops, threaded over (token, head) items, each
        reading its sequence's ``L + dr`` numbers per cached token and never expanding a key or a
        value. The expanded form (prompt chunks under ``auto``) and anything the kernel does not
        take (no kernels, not float32) run :meth:`ReferenceOps.mla_paged_attention`."""
        if form not in self.mla_forms:
            raise ValueError(f"mla_paged_attention form {form!r} is not one of {', '.join(self.mla_forms)}")
        absorbed = form == "absorbed" or (form == "auto" and meta.is_decode_only)
        if (
            not absorbed
            or not (self._have_kernels or self._ready())
            or not isinstance(latent_cache, paddle.Tensor)
            or q.ndim != 3
            or any(t.dtype != paddle.float32 for t in (q, latent, latent_cache, w_kv))
        ):
            return ReferenceOps.mla_paged_attention(self, q, latent, latent_cache, meta, w_kv, scale, form)
        return _run(
            "fd_mla_absorbed_attention",
            q,
            latent,
            latent_cache,
            meta.slot_mapping,
            meta.tensor("query_start_loc"),
            meta.tensor("seq_lens"),
            meta.tensor("block_tables"),
            w_kv,
            float(scale),
        )[0]
