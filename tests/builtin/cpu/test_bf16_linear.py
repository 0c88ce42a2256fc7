"""``fd_bf16_linear`` (csrc/bf16_gemm.cc): bfloat16 weights in k-pair tiles, activations rounded
to bfloat16, float32 sums; its ``vdpbf16ps`` path and its widening path.

Both paths sum each output in one fixed order (per pair of k: the odd k, then the even k), so
each is compared bit for bit with a numpy emulation of that order, on every path this CPU can
run (the widening path is forced through the op's ``path`` argument, so it runs everywhere; the
dot path needs AVX-512 BF16). The widening path of a call with more than 4 rows (AVX2) or 10
rows (AVX-512) widens each tile once and runs fd_f32_linear's loop over a buffer in the same
order: the cases with 5 / 11 or more rows run that, fewer rows the per-block widening. Against the reference formula (``ReferenceOps.bf16_linear``, any
summation order) the comparison is a float32 tolerance.

The AMX path (tiles, ``tdpbf16ps``) sums in the instruction's order: per 16 k pairs two chains
(even and odd k) from zero, their sum added to the output. Its loop also runs on a software model
of the tile instructions (path 4) on every CPU, compared bit for bit with a numpy emulation of that
order: that checks the loop's addressing, padding and tails on any CPU. The instructions themselves
run only on a CPU with AMX-BF16 (path 3, compared bit for bit with the same emulation: they agreed
on an Intel Xeon with AMX, 2026-12-06); on others the tests say so.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.builtin.cpu.kernels import amx_state as kernel_amx_state
from fastdeploy_core.builtin.cpu.kernels import has_amx_bf16, has_avx512_bf16, load_kernels, matrix_paths
from fastdeploy_core.builtin.cpu.layout import pack_bf16_pair_tiles, unpack_bf16_pair_tiles, unpack_column_tiles
from fastdeploy_core.builtin.cpu.ops import CpuOps
from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.quantization.codes import bfloat16_bits

WIDEN, DOT, AUTO, AMX, AMX_MODEL = 1, 2, 0, 3, 4


def amx_state(model: int = 0) -> int:
    """``fd_bf16_amx_state`` (``kernels.amx_state``): 0 no AMX tiles here, 1 the auto path uses
    them, 2 they failed the kernel's self-check (``model=1``: that self-check on the tile model)."""
    return kernel_amx_state("fd_bf16_amx_state", model)


AMX_IN_USE = amx_state() == 1
#: Paths that sum in the widening order (the auto path does unless it takes tiles).
PATHS = [WIDEN] + ([] if AMX_IN_USE else [AUTO]) + ([DOT] if has_avx512_bf16() else [])
#: Paths through the tile loop: its model everywhere, the instructions where the CPU has them.
AMX_PATHS = [AMX_MODEL] + ([AMX] if AMX_IN_USE else [])


@pytest.fixture(scope="module")
def ops():
    if load_kernels() is None:
        pytest.skip("the cpu kernels cannot be built here")
    return CpuOps()


def widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def emulate(x: np.ndarray, weight_bits: np.ndarray) -> np.ndarray:
    """The kernel's sums: per output, pairs of k in order, odd k before even k, float32."""
    xr, w = widen(bfloat16_bits(x)), widen(weight_bits)
    acc = np.zeros((x.shape[0], w.shape[1]), np.float32)
    for j in range(x.shape[1] // 2):
        for k in (2 * j + 1, 2 * j):
            acc = acc + xr[:, k : k + 1] * w[k]  # the product is exact in float32; the sum rounds
    return acc


def emulate_tiles(x: np.ndarray, weight_bits: np.ndarray) -> np.ndarray:
    """tdpbf16ps's sums: per 16 k pairs (zeros past K) and output, the even k's products and the
    odd k's each summed from zero in order, then their sum added to the output, float32."""
    xr, w = widen(bfloat16_bits(x)), widen(weight_bits)
    k_pad = -(-x.shape[1] // 32) * 32
    xr = np.pad(xr, ((0, 0), (0, k_pad - x.shape[1])))
    w = np.pad(w, ((0, k_pad - w.shape[0]), (0, 0)))
    acc = np.zeros((x.shape[0], w.shape[1]), np.float32)
    for start in range(0, k_pad, 32):
        chains = [np.zeros_like(acc), np.zeros_like(acc)]
        for k in range(start, start + 32):
            chains[k % 2] = chains[k % 2] + xr[:, k : k + 1] * w[k]
        acc = acc + (chains[0] + chains[1])
    return acc


def case(rng, m: int, k: int, n: int):
    x = rng.standard_normal((m, k)).astype(np.float32)
    bits = bfloat16_bits(rng.standard_normal((k, n)) / np.sqrt(k))
    return x, bits


def test_bfloat16_bits_round_like_paddles_cast():
    rng = np.random.default_rng(0)
    values = np.concatenate([
        rng.standard_normal(4096).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 4096),
        # ties: halfway between two bfloat16 values, with an even and an odd lower neighbour
        np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130, -(2**-135), 3.4e38, np.inf, -np.inf, 0.0, -0.0],
                 np.float32),
    ]).astype(np.float32)
    ours = bfloat16_bits(values)
    paddles = paddle.to_tensor(values).astype("bfloat16").view(paddle.uint16).numpy()
    np.testing.assert_array_equal(ours, paddles)
    assert widen(bfloat16_bits(np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32))).tolist() == [1.0, 1 + 2**-6]
    assert np.isnan(widen(bfloat16_bits(np.array([np.nan], np.float32))))[0]


def test_pair_layout_round_trips_and_puts_a_columns_k_pair_in_one_lane():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 1 << 16, size=(6, 64), dtype=np.uint16)
    packed = pack_bf16_pair_tiles(paddle.to_tensor(bits))
    assert packed.dtype == paddle.bfloat16 and packed.shape == [2, 3, 32, 2]
    raw = packed.view(paddle.uint16).numpy()
    assert raw[1, 2, 5, 0] == bits[4, 32 + 5] and raw[1, 2, 5, 1] == bits[5, 32 + 5]
    np.testing.assert_array_equal(unpack_bf16_pair_tiles(packed).view(paddle.uint16).numpy(), bits)
    np.testing.assert_array_equal(unpack_column_tiles(packed).view(paddle.uint16).numpy(), bits)
    with pytest.raises(ValueError, match="K % 2 == 0 and N % 32 == 0"):
        pack_bf16_pair_tiles(paddle.to_tensor(bits[:5]))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "m,k,n",
    [(1, 64, 32), (2, 576, 96), (3, 128, 64), (4, 576, 64), (5, 576, 64), (8, 64, 960), (9, 96, 64), (13, 576, 96),
     (17, 1536, 64), (64, 576, 192), (130, 96, 96)],
)
def test_kernel_is_bitwise_its_summation_order_on_each_path(ops, path, m, k, n):
    x, bits = case(np.random.default_rng(m * 1000 + k + n), m, k, n)
    packed = ops.prepare_linear_weight(paddle.to_tensor(bits))
    assert packed is not None and packed.ndim == 4
    got = ops.bf16_linear(paddle.to_tensor(x), packed, path=path).numpy()
    np.testing.assert_array_equal(got, emulate(x, bits))


@pytest.mark.parametrize(
    "m,k,n",
    # rows: under one tile, one tile, a tile and a row, two tiles (32) and a part, a panel of 64;
    # more than one panel of the AMX loop (K = 1536: panels of 320 rows with a 2 MiB L2, of 64
    # to 512 elsewhere, row_panels.h's panel_rows_for);
    # k pairs: whole tiles of 16 (576, 1536) and tails (40, 50, 8 pairs of the 80-wide case)
    [(1, 64, 32), (5, 80, 64), (16, 576, 96), (17, 1536, 64), (31, 96, 96), (33, 80, 64), (64, 576, 192),
     (130, 100, 64), (530, 1536, 32)],
)
def test_tile_loop_on_the_model_is_bitwise_the_instructions_order(ops, m, k, n):
    x, bits = case(np.random.default_rng(m * 1000 + k + n + 1), m, k, n)
    packed = ops.prepare_linear_weight(paddle.to_tensor(bits))
    got = ops.bf16_linear(paddle.to_tensor(x), packed, path=AMX_MODEL).numpy()
    np.testing.assert_array_equal(got, emulate_tiles(x, bits))
    # The two orders differ in the last bits (so this test tells the tile loop from the others).
    assert not np.array_equal(got, emulate(x, bits)) or k <= 64


@pytest.mark.skipif(not AMX_IN_USE, reason="no AMX-BF16 tiles in use on this CPU: the tile instructions "
                    "were not executed (their loop runs on the model above)")
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (17, 1536, 64), (33, 80, 64), (130, 100, 64), (530, 1536, 32)])
def test_tile_instructions_give_the_model_bit_for_bit(ops, m, k, n):
    x, bits = case(np.random.default_rng(m + k + n), m, k, n)
    packed = ops.prepare_linear_weight(paddle.to_tensor(bits))
    got = ops.bf16_linear(paddle.to_tensor(x), packed, path=AMX).numpy()
    np.testing.assert_array_equal(got, emulate_tiles(x, bits))
    np.testing.assert_array_equal(ops.bf16_linear(paddle.to_tensor(x), packed, path=AUTO).numpy(), got)


@pytest.mark.parametrize("path", PATHS + AMX_PATHS)
def test_kernel_is_the_reference_formula_within_float32_rounding(ops, path):
    rng = np.random.default_rng(7)
    x, bits = case(rng, 13, 576, 1536)
    bias = rng.standard_normal(1536).astype(np.float32)
    weight = paddle.to_tensor(bits)
    want = ReferenceOps().bf16_linear(paddle.to_tensor(x), weight, paddle.to_tensor(bias)).numpy()
    got = ops.bf16_linear(paddle.to_tensor(x), ops.prepare_linear_weight(weight), paddle.to_tensor(bias), path=path)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    # ...and rounding x matters at that tolerance: the float32 product of the same weights is far.
    unrounded = x @ widen(bits) + bias
    assert np.abs(unrounded - want).max() > 100 * 1e-5


@pytest.mark.parametrize("path", PATHS + AMX_PATHS)
def test_activations_round_to_nearest_even(ops, path):
    """An identity weight returns x as the kernel rounded it: ties go to the even neighbour."""
    x = np.array([[1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20, 3.0, -0.5] + [0.0] * 26], np.float32)
    eye = bfloat16_bits(np.eye(32, dtype=np.float32))
    got = ops.bf16_linear(paddle.to_tensor(x), ops.prepare_linear_weight(paddle.to_tensor(eye)), path=path).numpy()
    assert got[0, :6].tolist() == [1.0, 1 + 2**-6, -1.0, 1 + 2**-7, 3.0, -0.5]


def test_shapes_the_layout_cannot_take_run_the_reference_formula(ops):
    rng = np.random.default_rng(3)
    for k, n in ((33, 64), (64, 24)):  # odd in, out not a multiple of 32
        x, bits = case(rng, 5, k, n)
        weight = paddle.to_tensor(bits)
        assert ops.prepare_linear_weight(weight) is None
        want = ReferenceOps().bf16_linear(paddle.to_tensor(x), weight).numpy()
        np.testing.assert_array_equal(ops.bf16_linear(paddle.to_tensor(x), weight).numpy(), want)


@pytest.mark.parametrize("path", [AUTO] + AMX_PATHS)
def test_batch_rows_do_not_change_a_rows_result(ops, path):
    """One accumulation order per output whatever the row blocking (blocks of 8, of 32 in tiles,
    panels of 64): row r alone == row r in a batch."""
    x, bits = case(np.random.default_rng(4), 131, 192, 64)
    packed = ops.prepare_linear_weight(paddle.to_tensor(bits))
    whole = ops.bf16_linear(paddle.to_tensor(x), packed, path=path).numpy()
    for r in (0, 8, 17, 63, 64, 127, 130):
        alone = ops.bf16_linear(paddle.to_tensor(x[r : r + 1]), packed, path=path).numpy()
        np.testing.assert_array_equal(alone, whole[r : r + 1])


def test_bad_inputs_are_refused_with_the_kernels_message(ops):
    x, bits = case(np.random.default_rng(5), 2, 64, 32)
    packed = ops.prepare_linear_weight(paddle.to_tensor(bits))
    with pytest.raises(Exception, match="does not fit the weight's 32 k pairs"):
        ops.bf16_linear(paddle.to_tensor(x[:, :48]), packed)
    with pytest.raises(Exception, match="path must be 0 .auto., 1 .widen., 2 .dot., 3 .amx. or 4"):
        ops.bf16_linear(paddle.to_tensor(x), packed, path=5)


def test_the_kernels_run_time_choice_agrees_with_the_cpus_flags(ops):
    """What the kernel detects (``__builtin_cpu_supports``) is what /proc/cpuinfo lists, so the
    paths above are the ones the kernel can run here."""
    from paddle import _C_ops

    detected = bool(_C_ops._run_custom_op("fd_bf16_dot_available", paddle.zeros([1]))[0].numpy()[0])
    assert detected == has_avx512_bf16()
    # AMX: a CPU listing AMX-BF16 tiles must run them and pass the kernel's self-check (state 1);
    # a CPU without them reports 0.
    assert amx_state() == (1 if has_amx_bf16() else 0)
    # The self-check's own logic, run (in a child process) on the tile model: it agrees; on
    # tiles that fault at their first instruction it says no, and this process lives on.
    assert amx_state(model=1) == 1
    assert amx_state(model=2) == 2
    with pytest.raises(ValueError, match="not one of the AMX state ops"):
        kernel_amx_state("fd_bf16_linear")
    # ...and what benchmarks record as the path they measured says the same.
    want = "amx tiles (tdpbf16ps)" if has_amx_bf16() else "vdpbf16ps" if has_avx512_bf16() else "widen to float32"
    assert matrix_paths()["bf16_linear"] == want


@pytest.mark.skipif(has_amx_bf16(), reason="this CPU has AMX-BF16: the tile path runs (tested above)")
def test_amx_path_is_refused_without_amx_tiles(ops):
    x, bits = case(np.random.default_rng(6), 2, 64, 32)
    with pytest.raises(Exception, match="needs AMX-BF16 tiles"):
        ops.bf16_linear(paddle.to_tensor(x), ops.prepare_linear_weight(paddle.to_tensor(bits)), path=AMX)


@pytest.mark.skipif(has_avx512_bf16(), reason="this CPU has AVX-512 BF16: the dot path runs (tested above)")
def test_dot_path_is_refused_without_avx512_bf16(ops):
    x, bits = case(np.random.default_rng(6), 2, 64, 32)
    with pytest.raises(Exception, match="needs AVX-512 BF16"):
        ops.bf16_linear(paddle.to_tensor(x), ops.prepare_linear_weight(paddle.to_tensor(bits)), path=DOT)


def test_a_captured_bf16_linear_replays_on_refreshed_input(ops, restore_ops):
    set_current_ops(ops)
    x_host = np.random.default_rng(8).standard_normal((3, 64)).astype(np.float32)
    x = paddle.utils.dlpack.from_dlpack(x_host)
    _, bits = case(np.random.default_rng(9), 1, 64, 96)
    packed = ops.prepare_linear_weight(paddle.to_tensor(bits))
    plan = ops.capture_graph(lambda: ops.bf16_linear(x, packed), [x, packed])
    graph = ops.capture_graph(lambda: ops.bf16_linear(x, packed), [x, packed], previous=plan)
    assert graph.ok, graph.reason
    x_host[:] = np.random.default_rng(10).standard_normal((3, 64)).astype(np.float32)
    graph.replay()
    # The auto path sums in the tile order where it takes AMX tiles, else in the widening order.
    want = emulate_tiles(x_host, bits) if AMX_IN_USE else emulate(x_host, bits)
    np.testing.assert_array_equal(graph.output.numpy(), want)
    graph.release()


# ---- fd_bf16_linear_silu: a merged gate/up projection and its SwiGLU in one op -------------------


def rne_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest, ties to even (no NaN here)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def linear_input_bits(x: np.ndarray) -> np.ndarray:
    """:func:`rne_bits` with a NaN as fd_bf16_linear rounds it: a quiet NaN of its sign and top bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rne_bits(np.where(nan, 0, x)))


def widen_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (Paddle hands bfloat16 to numpy as uint16) -> float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def silu_and_mul_numpy(y: np.ndarray) -> np.ndarray:
    """silu(gate) * up of the two halves, float32, within float32 rounding of the kernels' formula."""
    gate, up = np.split(y.astype(np.float64), 2, axis=-1)
    return (gate / (1 + np.exp(-gate)) * up).astype(np.float32)


@pytest.mark.parametrize("path", AMX_PATHS)
@pytest.mark.parametrize(
    "m,k,n",
    # rows: one, a tile and one more, two blocks of 32 and a part, more than one AMX panel (K = 1536:
    # 320 rows with a 2 MiB L2); k pairs with and without a tail of a tile; halves of one and three tiles
    [(1, 64, 64), (17, 576, 192), (70, 100, 64), (530, 1536, 64)],
)
def test_fused_swiglu_is_the_linear_then_silu_and_mul_bit_for_bit(ops, path, m, k, n):
    x, bits = case(np.random.default_rng(m + k + n + 7), m, k, n)
    packed = ops.prepare_linear_weight(paddle.to_tensor(bits))
    fused = load_kernels().fd_bf16_linear_silu(paddle.to_tensor(x), packed, path)
    assert fused.dtype == paddle.bfloat16 and fused.shape == [m, n // 2]
    product = ops.bf16_linear(paddle.to_tensor(x), packed, path=path)
    two_ops = ops.silu_and_mul(product).numpy()
    # the two ops' float32 values rounded to bfloat16 as fd_bf16_linear rounds its input
    np.testing.assert_array_equal(fused.numpy(), rne_bits(two_ops))
    # ...and that is SwiGLU of the tile order's sums (not of another product of the same weights)
    np.testing.assert_allclose(widen_bits(fused.numpy()), silu_and_mul_numpy(emulate_tiles(x, bits)), rtol=2**-8, atol=1e-6)


def test_fused_swiglu_refuses_what_it_cannot_take(ops):
    x, bits = case(np.random.default_rng(5), 3, 64, 96)
    packed = ops.prepare_linear_weight(paddle.to_tensor(bits))  # 3 tiles: no whole halves
    with pytest.raises(Exception, match="gate and up halves must be whole tiles of 32 columns"):
        load_kernels().fd_bf16_linear_silu(paddle.to_tensor(x), packed, AMX_MODEL)
    x, bits = case(np.random.default_rng(6), 3, 64, 64)
    packed = ops.prepare_linear_weight(paddle.to_tensor(bits))
    with pytest.raises(Exception, match=r"path must be 3 \(amx\) or 4"):
        load_kernels().fd_bf16_linear_silu(paddle.to_tensor(x), packed, AUTO)
    if not has_amx_bf16():
        with pytest.raises(Exception, match="the amx path needs AMX-BF16 tiles"):
            load_kernels().fd_bf16_linear_silu(paddle.to_tensor(x), packed, AMX)


@pytest.mark.parametrize("bias", [False, True])
def test_ops_fuse_the_swiglu_only_where_the_linears_take_tiles(ops, bias, cpu_kernel_calls):
    """``CpuOps.bf16_linear_silu_and_mul`` gives the two ops' bits whichever way it goes: one
    kernel where the auto path multiplies in AMX tiles (and there is no bias), else the two ops."""
    x, bits = case(np.random.default_rng(11), 40, 576, 128)
    packed = ops.prepare_linear_weight(paddle.to_tensor(bits))
    b = paddle.to_tensor(np.random.default_rng(12).standard_normal(128).astype(np.float32)) if bias else None
    called = cpu_kernel_calls
    got = ops.bf16_linear_silu_and_mul(paddle.to_tensor(x), packed, b)
    fused = AMX_IN_USE and not bias and ops.bf16_path == AUTO
    assert called == (["fd_bf16_linear_silu"] if fused else ["fd_bf16_linear", "fd_silu_mul"])
    want = ops.silu_and_mul(ops.bf16_linear(paddle.to_tensor(x), packed, b))
    # the kernel's SwiGLU is bfloat16 (rounded once, there), the two ops' float32: the down
    # projection after either computes the same bits
    assert got.dtype == (paddle.bfloat16 if fused else paddle.float32)
    np.testing.assert_array_equal(got.numpy(), rne_bits(want.numpy()) if fused else want.numpy())
    _, down = case(np.random.default_rng(13), 1, 64, 64)
    down = ops.prepare_linear_weight(paddle.to_tensor(down))
    np.testing.assert_array_equal(ops.bf16_linear(got, down).numpy(), ops.bf16_linear(want, down).numpy())


@pytest.mark.parametrize("path", PATHS + AMX_PATHS)
@pytest.mark.parametrize(
    "m,k,n,offset",
    # rows a multiple of 16 and K whole tiles of pairs: read in place (when 64-byte aligned: also a
    # view one 128-byte row in); rows that are not, K with a tail of a tile (100, 62), and rows
    # that start off a 64-byte line (a view one 144-byte row in): copied first
    [(32, 64, 64, 0), (48, 64, 64, 1), (17, 576, 96, 0), (40, 100, 64, 0), (5, 62, 32, 0), (48, 72, 64, 1)],
)
def test_bfloat16_rows_give_what_their_float32_values_give(ops, path, m, k, n, offset):
    """x already rounded to bfloat16 (fd_bf16_linear_silu's output) is read as it is: the same
    bits as the float32 values it holds, on every path, read in place or copied."""
    x, bits = case(np.random.default_rng(m + k + n), m + offset, k, n)
    packed = ops.prepare_linear_weight(paddle.to_tensor(bits))
    rows = paddle.to_tensor(x).astype("bfloat16")[offset:]
    assert rows.dtype == paddle.bfloat16
    got = load_kernels().fd_bf16_linear(rows, packed, path).numpy()
    want = load_kernels().fd_bf16_linear(paddle.to_tensor(widen_bits(rows.numpy())), packed, path).numpy()
    np.testing.assert_array_equal(got, want)
    assert got.shape == (m, n) and not np.array_equal(want, load_kernels().fd_bf16_linear(
        paddle.to_tensor(x[offset:] * 1.01), packed, path).numpy())


@pytest.mark.parametrize("rows,hidden", [(1, 576), (70, 576), (600, 64), (3, 100), (5, 17)])
def test_norms_round_their_rows_as_the_bf16_linear_rounds_its_input(ops, rows, hidden):
    """``fd_rms_norm_bf16`` / ``fd_add_rms_norm_bf16`` (``CpuOps.rms_norm_bf16_rows``): the float32
    norms' rows rounded to bfloat16 as ``fd_bf16_linear`` rounds its input (nearest, ties to even,
    a NaN quiet), the residual sum unchanged; whole vectors of 32, a tail, one row and the pool's
    chunks; and a bf16 linear after them gives what it gives from the float32 rows."""
    rng = np.random.default_rng(rows + hidden)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    residual = rng.standard_normal((rows, hidden)).astype(np.float32)
    weight = paddle.to_tensor(rng.standard_normal(hidden).astype(np.float32))
    x[0, hidden // 2] = np.nan  # that row's values all turn NaN: quiet NaNs of the float32 NaNs' sign
    for res in (None, paddle.to_tensor(residual)):
        normed, summed = ops.rms_norm_bf16_rows(paddle.to_tensor(x), res, weight, 1e-6)
        want, want_sum = ops.add_rms_norm(paddle.to_tensor(x), res, weight, 1e-6)
        assert normed.dtype == paddle.bfloat16 and list(normed.shape) == [rows, hidden]
        np.testing.assert_array_equal(normed.numpy(), linear_input_bits(want.numpy()))
        np.testing.assert_array_equal(summed.numpy(), want_sum.numpy())
    if hidden % 2 == 0 and rows > 1:
        _, bits = case(rng, 1, hidden, 64)
        packed = ops.prepare_linear_weight(paddle.to_tensor(bits))
        np.testing.assert_array_equal(ops.bf16_linear(normed[1:], packed).numpy(), ops.bf16_linear(want[1:], packed).numpy())


# ---- fd_bf16_linear_argmax: a bfloat16 LM head's greedy tokens without the logits ----------------


@pytest.mark.parametrize("path", AMX_PATHS)
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (5, 576, 4096), (40, 100, 160), (530, 1536, 64)])
def test_fused_argmax_is_argmax_rows_of_the_linear(ops, path, m, k, n):
    rng = np.random.default_rng(m + k + n + 3)
    x, bits = case(rng, m, k, n)
    # three equal columns (the first, one 3 columns on in its tile, and the last, of another tile
    # when n > 32) that hold row 0's maximum: the first wins
    bits[:, n // 2] = bfloat16_bits(np.abs(widen(bits[:, n // 2])) + 1.0)
    bits[:, n - 1] = bits[:, n // 2]
    bits[:, n // 2 + 3] = bits[:, n // 2]  # and a later column of the same tile
    x[0] = np.abs(x[0])
    if m > 2:
        x[1, 3] = np.nan  # a NaN row: every logit NaN, token 0 (fd_argmax's rule)
    packed = ops.prepare_linear_weight(paddle.to_tensor(bits))
    got = load_kernels().fd_bf16_linear_argmax(paddle.to_tensor(x), packed, path).numpy()
    logits = ops.bf16_linear(paddle.to_tensor(x), packed, path=path)
    np.testing.assert_array_equal(got, ops.argmax_rows(logits))
    assert got[0] == n // 2 and logits.numpy()[0, n - 1] == logits.numpy()[0, n // 2]
    if m > 2:
        assert got[1] == 0
    # the tokens of the tile order's logits (numpy's argmax: first index, on NaN-free rows)
    want = np.argmax(emulate_tiles(x, bits), axis=1)
    finite = ~np.isnan(x).any(axis=1)
    np.testing.assert_array_equal(got[finite], want[finite])


def test_ops_take_the_fused_argmax_only_where_the_linears_take_tiles(ops, cpu_kernel_calls):
    x, bits = case(np.random.default_rng(21), 7, 576, 1024)
    packed = ops.prepare_linear_weight(paddle.to_tensor(bits))
    called = cpu_kernel_calls
    got = ops.bf16_linear_argmax(paddle.to_tensor(x), packed)
    fused = AMX_IN_USE and ops.bf16_path == AUTO
    assert called == (["fd_bf16_linear_argmax"] if fused else ["fd_bf16_linear", "fd_argmax"])
    np.testing.assert_array_equal(got, ops.argmax_rows(ops.bf16_linear(paddle.to_tensor(x), packed)))
