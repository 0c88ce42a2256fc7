"""``w8a8`` with integer products: the int8 quad layout ``[N / 32, K / 4, 32, 4]`` and ``fd_w8a8_linear``.

The kernel rounds each row of x to int8 (``|x|max / 127``, ties to even as ``paddle.round``) and sums the
products of the codes in int32 (``vpdpbusd`` on AVX-512 VNNI, ``vpmaddubsw`` + ``vpmaddwd`` on
AVX2, a scalar loop elsewhere); the result is ``(float32(sum) * w_scale[n]) * x_scale[m]``. The
sums are exact, so the tests compare bit for bit with that formula computed in numpy (int64
sums), and within float32 summation error with the quantizer's reference formula.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.builtin.cpu.layout import pack_int8_quad_tiles, unpack_column_tiles, unpack_int8_quad_tiles
from fastdeploy_core.builtin.cpu.ops import CpuOps
from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.layers.linear import Linear
from fastdeploy_core.quantization.codes import quantize_int8
from fastdeploy_core.quantization.w8a8 import W8A8
from fastdeploy_core.quantization.weight_only import int8_linear_reference


def gaussian(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def formula(x: np.ndarray, q: np.ndarray, ws: np.ndarray) -> np.ndarray:
    """The kernel's result in numpy: int8 rows (ties to even), exact integer sums."""
    amax = np.abs(x).max(axis=1, keepdims=True)
    xs = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    xq = np.rint(np.clip((x / xs).astype(np.float32), -127, 127)).astype(np.int64)  # float32 division, ties to even
    sums = xq @ q.astype(np.int64)
    return ((sums.astype(np.float32) * ws.reshape(1, -1)).astype(np.float32) * xs).astype(np.float32)


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


# rows: one (decode), a register block and its remainders, more than one panel of 64 rows.
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13, 64, 130])
@pytest.mark.parametrize("shape", [(576, 96), (1536, 64), (44, 160)], ids=["576x96", "1536x64", "44x160"])
def test_kernel_equals_its_integer_formula_bit_for_bit(rows, shape, cpu_kernels):
    K, N = shape
    rng = np.random.default_rng(rows * 7 + K)
    q = rng.integers(-127, 128, (K, N)).astype(np.int8)
    ws = (rng.random(N).astype(np.float32) + 0.5) / 127
    x = gaussian(rng, (rows, K))
    x[0, 3] *= 40.0  # an outlier channel
    if rows > 2:
        x[1] = 0.0  # a zero row: scale 1, codes 0
        x[2, :8] = [0.5, -0.5, 1.5, -2.5, 126.5, -126.5, 127.0, 0.25]  # ties (scale 1): to even
    want = formula(x, q, ws)
    got = cpu_kernels.fd_w8a8_linear(
        paddle.to_tensor(x), pack_int8_quad_tiles(paddle.to_tensor(q)), paddle.to_tensor(ws.reshape(1, N))
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
        paddle.to_tensor(x), pack_int8_quad_tiles(paddle.to_tensor(eye)), paddle.ones([1, N])
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
    got = cpu_kernels.fd_w8a8_linear(x, pack_int8_quad_tiles(w), scale).numpy()
    # the same products; the reference sums them in float32
    assert float(np.abs(got - want).max() / np.abs(want).max()) <= 2e-6


def test_kernel_checks_its_arguments(cpu_kernels):
    packed = pack_int8_quad_tiles(paddle.zeros([64, 32], dtype="int8"))
    assert tuple(cpu_kernels.fd_w8a8_linear(paddle.ones([2, 3, 64]), packed, paddle.ones([1, 32])).shape) == (2, 3, 32)
    with pytest.raises(Exception, match="must equal the weight's K"):
        cpu_kernels.fd_w8a8_linear(paddle.ones([2, 60]), packed, paddle.ones([1, 32]))
    with pytest.raises(Exception, match="one value per output channel"):
        cpu_kernels.fd_w8a8_linear(paddle.ones([2, 64]), packed, paddle.ones([2, 32]))
    with pytest.raises(Exception, match="int8"):
        cpu_kernels.fd_w8a8_linear(paddle.ones([2, 64]), packed.astype("int32"), paddle.ones([1, 32]))


def test_w8a8_layers_take_the_quad_layout_and_keep_their_weights(cpu_kernels, monkeypatch):
    monkeypatch.setattr(CpuOps, "w8a8_int_dot", True)  # the layout works on any build
    rng = np.random.default_rng(12)
    set_current_ops(CpuOps())
    quantizer = W8A8()
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
    np.testing.assert_array_equal(got, formula(x.numpy(), codes, ws))
    assert float(np.abs(got - want).max() / np.abs(want).max()) <= 2e-6
    quantizer.process_weights_after_loading(layer)  # a second call leaves it as it is
    assert tuple(layer.weight.shape) == (3, 96, 32, 4)
    # the reference formula reads the packed storage handed back by the ops table
    np.testing.assert_array_equal(quantizer.reference_op(x, *quantizer.reference_args(layer)).numpy(), want)


@pytest.mark.parametrize("case", ["groups", "k-not-multiple-of-4", "code--128", "switched-off"])
def test_w8a8_keeps_the_float_products_where_the_quad_layout_does_not_apply(case, cpu_kernels, monkeypatch):
    monkeypatch.setattr(CpuOps, "w8a8_int_dot", case != "switched-off")
    rng = np.random.default_rng(21)
    set_current_ops(CpuOps())
    quantizer = W8A8({"group_size": 32}) if case == "groups" else W8A8()
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
