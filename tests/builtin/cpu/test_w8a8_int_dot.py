"""``w8a8`` and ``wint8`` with integer products: the int8 quad layout ``[N / 32, K / 4, 32, 4]`` and ``fd_w8a8_linear``.

With one piece (w8a8) the kernel rounds each row of x to int8 (``|x|max / 127``, ties to even as
``paddle.round``) and sums the products of the codes in int32 (``vpdpbusd`` on AVX-512 VNNI,
``vpmaddubsw`` + ``vpmaddwd`` on AVX2, a scalar loop elsewhere); the result is
``(float32(sum) * w_scale[n]) * x_scale[m]``. With two pieces (wint8) each row is rounded to
16 bits (``|x|max / 32639``) held as ``256 hi + lo``; the result is
``(fma(float32(sum hi q), 256, float32(sum lo q)) * w_scale[n]) * x_scale[m]``. The sums are
exact, so the tests compare bit for bit with those formulas computed in numpy (int64 sums), and
within the activations' rounding with the quantizers' float32 reference formulas.

Every path gives those bits: the vector loop, AMX-INT8 tiles (``tdpbssd``; only on a CPU that has
them, else the tests say so) and the tile loop on a software model of the instructions, which
runs everywhere and checks the loop's addressing, padding and tails on CPUs without AMX.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.builtin.cpu.kernels import amx_state as kernel_amx_state
from fastdeploy_core.builtin.cpu.kernels import has_amx_int8
from fastdeploy_core.builtin.cpu.layout import pack_int8_quad_tiles, unpack_column_tiles, unpack_int8_quad_tiles
from fastdeploy_core.builtin.cpu.ops import CpuOps
from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.layers.linear import Linear
from fastdeploy_core.quantization.codes import quantize_int8
from fastdeploy_core.quantization.w8a8 import W8A8
from fastdeploy_core.quantization.weight_only import WeightOnlyInt8, int8_linear_reference


AUTO, VECTOR, AMX, AMX_MODEL = 0, 1, 2, 3


def amx_state(model: int = 0) -> int:
    """``fd_w8a8_amx_state`` (``kernels.amx_state``): 1 when the auto path takes AMX-INT8 tiles
    here (``model=1``: the kernel's self-check run on the tile model passes), else 0 or 2."""
    return kernel_amx_state("fd_w8a8_amx_state", model)


PATHS = [AUTO, VECTOR, AMX_MODEL] + ([AMX] if amx_state() else [])


def gaussian(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def formula(x: np.ndarray, q: np.ndarray, ws: np.ndarray, pieces: int = 1) -> np.ndarray:
    """The kernel's result in numpy: rows rounded per row (ties to even), exact integer sums."""
    top = np.float32(127 if pieces == 1 else 32639)
    amax = np.abs(x).max(axis=1, keepdims=True)
    xs = np.where(amax > 0, amax / top, np.float32(1)).astype(np.float32)
    a = np.rint(np.clip((x / xs).astype(np.float32), -top, top)).astype(np.int64)  # float32 division, ties to even
    if pieces == 1:
        v = (a @ q.astype(np.int64)).astype(np.float32)
    else:
        hi = (a + 128) >> 8
        lo = a - 256 * hi
        assert hi.min() >= -127 and hi.max() <= 127 and lo.min() >= -128 and lo.max() <= 127
        sh = (hi @ q.astype(np.int64)).astype(np.float32).astype(np.float64)
        sl = (lo @ q.astype(np.int64)).astype(np.float32).astype(np.float64)
        v = (sh * 256 + sl).astype(np.float32)  # exact in float64, then one rounding: the fma
    return ((v * ws.reshape(1, -1)).astype(np.float32) * xs).astype(np.float32)


@pytest.mark.parametrize("shape", [(4, 32), (576, 96), (1536, 64), (44, 160)])
def test_quad_packing_is_an_exact_inverse_and_puts_each_code_where_the_kernel_reads_it(shape):
    K, N = shape
    rng = np.random.default_rng(K + N)
    codes = rng.integers(-127, 128, (K, N)).astype(np.int8)
    packed = pack_int8_quad_tiles(paddle.to_tensor(codes))
    assert tuple(packed.shape) == (N // 32, K // 4, 32, 4) and packed.dtype == paddle.int8
    np.testing.assert_array_equal(unpack_int8_quad_tiles(packed).numpy(), codes)
    np.testing.assert_array_equal(unpack_column_tiles(packed).numpy(), codes)
    raw = packed.numpy()
    for t, c, n, j in [(0, 0, 0, 0), (N // 32 - 1, K // 4 - 1, 31, 3), (N // 32 // 2, K // 8, 17, 2)]:
        assert raw[t, c, n, j] == codes[4 * c + j, 32 * t + n]


def test_quad_packing_rejects_shapes_it_cannot_hold():
    with pytest.raises(ValueError, match="K % 4"):
        pack_int8_quad_tiles(paddle.zeros([6, 32], dtype="int8"))
    with pytest.raises(ValueError, match="N % 32"):
        pack_int8_quad_tiles(paddle.zeros([8, 48], dtype="int8"))


# rows: one (decode), a register block and its remainders, a tile of 16 and one more, more than
# one panel of 64 rows, more than one panel of the AMX loop (row_panels.h's panel_rows_for: 320
# rows at K = 1536 with two pieces and a 2 MiB L2, at most 512 anywhere); K: 144 / 384 / 11 quads
# (tails of 0 / 0 / 11 in tiles of 16 quads).
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pieces", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 17, 64, 130, 530])
@pytest.mark.parametrize("shape", [(576, 96), (1536, 64), (44, 160)], ids=["576x96", "1536x64", "44x160"])
def test_kernel_equals_its_integer_formula_bit_for_bit(path, pieces, rows, shape, cpu_kernels):
    K, N = shape
    rng = np.random.default_rng(rows * 7 + K + pieces)
    q = rng.integers(-127, 128, (K, N)).astype(np.int8)
    ws = (rng.random(N).astype(np.float32) + 0.5) / 127
    x = gaussian(rng, (rows, K))
    x[0, 3] *= 40.0  # an outlier channel
    if rows > 2:
        x[1] = 0.0  # a zero row: scale 1, codes 0
        x[2, :8] = [0.5, -0.5, 1.5, -2.5, 126.5, -126.5, 127.0, 0.25]  # ties (scale 1): to even
    if rows > 3 and pieces == 2:
        x[3, :4] = [1.0, 128.0 / 32639, -128.0 / 32639, 384.0 / 32639]  # low pieces of -128 (scale 1 / 32639)
        x[3, 4:] = np.clip(x[3, 4:], -0.9, 0.9)
    want = formula(x, q, ws, pieces)
    got = cpu_kernels.fd_w8a8_linear(
        paddle.to_tensor(x), pack_int8_quad_tiles(paddle.to_tensor(q)), paddle.to_tensor(ws.reshape(1, N)), pieces, path
    ).numpy()
    np.testing.assert_array_equal(got, want)
    if rows > 2:
        np.testing.assert_array_equal(got[1], 0.0)


def test_kernel_rounds_ties_to_even_as_paddle_round_does(cpu_kernels):
    """Row codes at exact halves: x / scale lands on k + 0.5 for a row whose max is 127."""
    K, N = 32, 32
    x = np.zeros((1, K), np.float32)
    x[0, 0] = 127.0  # scale 1
    x[0, 1:9] = [0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, -0.49999997]
    eye = np.zeros((K, N), np.int8)
    eye[np.arange(K), np.arange(N)] = 1
    got = cpu_kernels.fd_w8a8_linear(
        paddle.to_tensor(x), pack_int8_quad_tiles(paddle.to_tensor(eye)), paddle.ones([1, N]), 1, 0
    ).numpy()
    np.testing.assert_array_equal(got[0, :9], [127, 0, 0, 2, -2, 2, -2, 0, 0])
    np.testing.assert_array_equal(got[0, 1:9], paddle.round(paddle.to_tensor(x[0, 1:9])).numpy())


def test_kernel_matches_the_w8a8_reference_formula(cpu_kernels):
    K, N = 576, 192
    rng = np.random.default_rng(5)
    stored = quantize_int8(gaussian(rng, (K, N)), K)
    w, scale = paddle.to_tensor(stored["weight"]), paddle.to_tensor(stored["weight_scale"])
    x = paddle.to_tensor(gaussian(rng, (9, K)))
    want = int8_linear_reference(x, w, scale, K, act_int8=True).numpy()
    got = cpu_kernels.fd_w8a8_linear(x, pack_int8_quad_tiles(w), scale, 1, 0).numpy()
    # the same products; the reference sums them in float32
    assert float(np.abs(got - want).max() / np.abs(want).max()) <= 2e-6


@pytest.mark.parametrize("outlier", [1.0, 100.0])
def test_two_pieces_stay_within_the_activations_rounding_of_the_wint8_formula(outlier, cpu_kernels):
    """wint8's float32 formula against 16-bit rows: each activation off by at most half a step of
    |x|max / 32639, so each output by at most that times the column's sum of |w| (plus float32
    summation); an outlier channel coarsens the row's step, as it should."""
    K, N = 1536, 96
    rng = np.random.default_rng(8)
    stored = quantize_int8(gaussian(rng, (K, N)), K)
    w, scale = paddle.to_tensor(stored["weight"]), paddle.to_tensor(stored["weight_scale"])
    xn = gaussian(rng, (7, K))
    xn[:, 5] *= outlier
    x = paddle.to_tensor(xn)
    want = int8_linear_reference(x, w, scale, K).numpy()
    got = cpu_kernels.fd_w8a8_linear(x, pack_int8_quad_tiles(w), scale, 2, 0).numpy()
    dense = (stored["weight"].astype(np.float64) * stored["weight_scale"]).astype(np.float64)
    step = np.abs(xn).max(axis=1, keepdims=True) / 32639
    bound = 0.5 * step * np.abs(dense).sum(axis=0, keepdims=True) + 1e-5 * np.abs(want).max()
    assert np.all(np.abs(got - want) <= bound)
    # and far closer than int8 activations get
    w8a8 = cpu_kernels.fd_w8a8_linear(x, pack_int8_quad_tiles(w), scale, 1, 0).numpy()
    assert np.abs(got - want).max() * 50 < np.abs(w8a8 - want).max()


def test_kernel_checks_its_arguments(cpu_kernels):
    packed = pack_int8_quad_tiles(paddle.zeros([64, 32], dtype="int8"))
    assert tuple(cpu_kernels.fd_w8a8_linear(paddle.ones([2, 3, 64]), packed, paddle.ones([1, 32]), 1, 0).shape) == (2, 3, 32)
    with pytest.raises(Exception, match="must equal the weight's K"):
        cpu_kernels.fd_w8a8_linear(paddle.ones([2, 60]), packed, paddle.ones([1, 32]), 1, 0)
    with pytest.raises(Exception, match="one value per output channel"):
        cpu_kernels.fd_w8a8_linear(paddle.ones([2, 64]), packed, paddle.ones([2, 32]), 2, 0)
    with pytest.raises(Exception, match="int8"):
        cpu_kernels.fd_w8a8_linear(paddle.ones([2, 64]), packed.astype("int32"), paddle.ones([1, 32]), 1, 0)
    with pytest.raises(Exception, match="pieces must be 1"):
        cpu_kernels.fd_w8a8_linear(paddle.ones([2, 64]), packed, paddle.ones([1, 32]), 3, 0)
    with pytest.raises(Exception, match="path must be 0 .auto., 1 .vector., 2 .amx. or 3"):
        cpu_kernels.fd_w8a8_linear(paddle.ones([2, 64]), packed, paddle.ones([1, 32]), 1, 4)
    if not has_amx_int8():
        with pytest.raises(Exception, match="needs AMX-INT8 tiles"):
            cpu_kernels.fd_w8a8_linear(paddle.ones([2, 64]), packed, paddle.ones([1, 32]), 1, AMX)


def test_the_tiles_are_used_where_the_cpu_lists_them(cpu_kernels):
    """A CPU listing AMX-INT8 must run the tiles and pass the kernel's self-check (its sums of a
    small problem equal the exact ones); one without reports 0. The self-check itself, run on the
    tile model, passes everywhere."""
    assert amx_state() == (1 if has_amx_int8() else 0)
    assert amx_state(model=1) == 1


# (method, its ops-table switch, activation pieces, relative distance from its float32 formula)
METHODS = {"w8a8": (W8A8, "w8a8_int_dot", 1, 2e-6), "wint8": (WeightOnlyInt8, "wint8_int_dot", 2, 2e-4)}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_layers_take_the_quad_layout_and_keep_their_weights(method, cpu_kernels, monkeypatch):
    cls, switch, pieces, tolerance = METHODS[method]
    monkeypatch.setattr(CpuOps, switch, True)  # the layout works on any build
    rng = np.random.default_rng(12)
    set_current_ops(CpuOps())
    quantizer = cls()
    layer = Linear(384, 96, quant_config=quantizer, prefix="model.layers.0.mlp.down_proj")
    layer.weight.weight_loader(layer.weight, gaussian(rng, (96, 384)))
    x = paddle.to_tensor(gaussian(rng, (5, 384)))
    dequantized = quantizer.dequantize(layer).numpy()
    codes, ws = layer.weight.numpy(), layer.weight_scale.numpy()
    want = quantizer.reference_op(x, *quantizer.op_args(layer)).numpy()
    quantizer.process_weights_after_loading(layer)
    assert tuple(layer.weight.shape) == (3, 96, 32, 4) and layer.weight.dtype == paddle.int8
    assert tuple(layer.weight_scale.shape) == (1, 96)
    np.testing.assert_array_equal(quantizer.dequantize(layer).numpy(), dequantized)
    got = layer(x).numpy()
    np.testing.assert_array_equal(got, formula(x.numpy(), codes, ws, pieces))
    assert float(np.abs(got - want).max() / np.abs(want).max()) <= tolerance
    # a row's result does not depend on the rows batched with it
    np.testing.assert_array_equal(layer(x[2:3]).numpy(), got[2:3])
    quantizer.process_weights_after_loading(layer)  # a second call leaves it as it is
    assert tuple(layer.weight.shape) == (3, 96, 32, 4)
    # the reference formula reads the packed storage handed back by the ops table
    np.testing.assert_array_equal(quantizer.reference_op(x, *quantizer.reference_args(layer)).numpy(), want)


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("case", ["groups", "k-not-multiple-of-4", "code--128", "switched-off"])
def test_layers_keep_the_float_products_where_the_quad_layout_does_not_apply(method, case, cpu_kernels, monkeypatch):
    cls, switch, _, _ = METHODS[method]
    monkeypatch.setattr(CpuOps, switch, case != "switched-off")
    rng = np.random.default_rng(21)
    set_current_ops(CpuOps())
    quantizer = cls({"group_size": 32}) if case == "groups" else cls()
    K = 66 if case == "k-not-multiple-of-4" else 64
    layer = Linear(K, 64, quant_config=quantizer, prefix="model.layers.0.mlp.down_proj")
    layer.weight.weight_loader(layer.weight, gaussian(rng, (64, K)))
    if case == "code--128":
        codes = layer.weight.numpy()
        codes[0, 0] = -128
        layer.weight.set_value(paddle.to_tensor(codes))
    x = paddle.to_tensor(gaussian(rng, (3, K)))
    want = quantizer.reference_op(x, *quantizer.op_args(layer)).numpy()
    quantizer.process_weights_after_loading(layer)
    assert layer.weight.ndim == 3  # the column tiles of fd_int8_linear
    assert float(np.abs(layer(x).numpy() - want).max() / np.abs(want).max()) <= 2e-6


def test_each_method_keeps_its_own_switch(cpu_kernels, monkeypatch):
    """FD_W8A8_INT_DOT=0 leaves w8a8 on float products even though wint8 (its base) takes quads."""
    monkeypatch.setattr(CpuOps, "w8a8_int_dot", False)
    monkeypatch.setattr(CpuOps, "wint8_int_dot", True)
    set_current_ops(CpuOps())
    rng = np.random.default_rng(3)
    layers = {}
    for cls in (W8A8, WeightOnlyInt8):
        layer = Linear(64, 64, quant_config=cls(), prefix="model.layers.0.mlp.down_proj")
        layer.weight.weight_loader(layer.weight, gaussian(rng, (64, 64)))
        cls().process_weights_after_loading(layer)
        layers[cls.name] = layer.weight.ndim
    assert layers == {"w8a8": 3, "wint8": 4}


# ---- fd_w8a8_linear_silu: a merged gate/up projection and its SwiGLU in one op ---------------------

TILE_PATHS = [AMX_MODEL] + ([AMX] if amx_state() == 1 else [])


@pytest.mark.parametrize("path", TILE_PATHS)
@pytest.mark.parametrize("pieces", [1, 2])
@pytest.mark.parametrize("rows", [16, 45, 530])  # a tile; a block and a part; past an AMX panel
@pytest.mark.parametrize("shape", [(576, 128), (1536, 64), (44, 192)], ids=["576x128", "1536x64", "44x192"])
def test_fused_swiglu_is_the_linear_then_silu_and_mul_bit_for_bit(path, pieces, rows, shape, cpu_kernels):
    K, N = shape
    rng = np.random.default_rng(rows + K + N + pieces)
    q = rng.integers(-127, 128, (K, N)).astype(np.int8)
    ws = (rng.random(N).astype(np.float32) + 0.5) / 127
    x = gaussian(rng, (rows, K))
    args = (paddle.to_tensor(x), pack_int8_quad_tiles(paddle.to_tensor(q)), paddle.to_tensor(ws.reshape(1, N)), pieces)
    fused = cpu_kernels.fd_w8a8_linear_silu(*args, path).numpy()
    product = cpu_kernels.fd_w8a8_linear(*args, VECTOR)  # any path: the same bits
    np.testing.assert_array_equal(product.numpy(), formula(x, q, ws, pieces))
    np.testing.assert_array_equal(fused, cpu_kernels.fd_silu_mul(product).numpy())
    assert fused.shape == (rows, N // 2)


def test_fused_swiglu_refuses_what_it_cannot_take(cpu_kernels):
    x = paddle.to_tensor(gaussian(np.random.default_rng(1), (16, 64)))
    three = pack_int8_quad_tiles(paddle.zeros([64, 96], dtype="int8"))
    with pytest.raises(Exception, match="gate and up halves must be whole tiles of 32 columns"):
        cpu_kernels.fd_w8a8_linear_silu(x, three, paddle.ones([1, 96]), 1, AMX_MODEL)
    two = pack_int8_quad_tiles(paddle.zeros([64, 64], dtype="int8"))
    with pytest.raises(Exception, match=r"path must be 2 \(amx\) or 3"):
        cpu_kernels.fd_w8a8_linear_silu(x, two, paddle.ones([1, 64]), 1, AUTO)
    if not has_amx_int8():
        with pytest.raises(Exception, match="the amx path needs AMX-INT8 tiles"):
            cpu_kernels.fd_w8a8_linear_silu(x, two, paddle.ones([1, 64]), 1, AMX)


def int8_layer(method: str, rows: int, n: int):
    """``(ops, weight, scale, x)``: a ``method`` layer [576, n] in the int8 quad layout and ``rows``
    rows of x; the test is skipped where the int8 layers keep float32 products."""
    ops = CpuOps()
    rng = np.random.default_rng(rows + n)
    codes = quantize_int8(gaussian(rng, (576, n)), 576)
    prepared = (ops.prepare_w8a8_weights if method == "w8a8" else ops.prepare_wint8_weights)(
        paddle.to_tensor(codes["weight"]), paddle.to_tensor(codes["weight_scale"]))
    if prepared is None:
        pytest.skip("no integer dot products here: the int8 layers keep float32 products")
    return (ops, *prepared, paddle.to_tensor(gaussian(rng, (rows, 576))))


@pytest.mark.parametrize("method", ["w8a8", "wint8"])
@pytest.mark.parametrize("rows", [3, 40])
def test_ops_fuse_the_swiglu_only_where_the_step_takes_int8_tiles(method, rows, cpu_kernel_calls, cpu_kernels):
    """``CpuOps.{w8a8,wint8}_linear_silu_and_mul`` give the two ops' bits either way: one kernel
    where ``fd_w8a8_linear``'s auto path takes AMX-INT8 tiles (16 rows or more), else the two ops."""
    ops, weight, scale, x = int8_layer(method, rows, 128)
    got = getattr(ops, f"{method}_linear_silu_and_mul")(x, weight, scale, 576).numpy()
    fused = rows >= 16 and amx_state() == 1 and ops.int8_tiles_path == AUTO
    assert cpu_kernel_calls == (["fd_w8a8_linear_silu"] if fused else ["fd_w8a8_linear", "fd_silu_mul"])
    linear = getattr(ops, f"{method}_linear")(x, weight, scale, 576)
    np.testing.assert_array_equal(got, ops.silu_and_mul(linear).numpy())


@pytest.mark.parametrize("path", TILE_PATHS)
@pytest.mark.parametrize("pieces", [1, 2])
@pytest.mark.parametrize("rows", [16, 45, 530])
def test_fused_argmax_is_argmax_rows_of_the_linear(path, pieces, rows, cpu_kernels):
    K, N = 576, 1024
    rng = np.random.default_rng(rows + pieces)
    q = rng.integers(-127, 128, (K, N)).astype(np.int8)
    # equal columns (two of one tile, one of the last) with row 0's maximum: the first wins
    q[:, N - 1] = q[:, 45] = q[:, 40] = np.abs(q[:, 40]).astype(np.int8)
    ws = np.full(N, 0.01, np.float32)
    x = gaussian(rng, (rows, K))
    x[0] = np.abs(x[0])
    x[1] = 0.0  # a zero row: every output 0, token 0
    args = (paddle.to_tensor(x), pack_int8_quad_tiles(paddle.to_tensor(q)), paddle.to_tensor(ws.reshape(1, N)), pieces)
    got = cpu_kernels.fd_w8a8_linear_argmax(*args, path).numpy()
    np.testing.assert_array_equal(got, cpu_kernels.fd_argmax(cpu_kernels.fd_w8a8_linear(*args, VECTOR)).numpy())
    assert got[0] == 40 and got[1] == 0


@pytest.mark.parametrize("method", ["w8a8", "wint8"])
@pytest.mark.parametrize("rows", [3, 40])
def test_ops_take_the_fused_argmax_only_where_the_step_takes_int8_tiles(method, rows, cpu_kernel_calls, cpu_kernels):
    ops, weight, scale, x = int8_layer(method, rows, 1024)
    got = getattr(ops, f"{method}_linear_argmax")(x, weight, scale, 576)
    fused = rows >= 16 and amx_state() == 1 and ops.int8_tiles_path == AUTO
    assert cpu_kernel_calls == (["fd_w8a8_linear_argmax"] if fused else ["fd_w8a8_linear", "fd_argmax"])
    np.testing.assert_array_equal(got, ops.argmax_rows(getattr(ops, f"{method}_linear")(x, weight, scale, 576)))
