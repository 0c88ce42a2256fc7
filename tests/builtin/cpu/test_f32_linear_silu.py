"""``fd_f32_linear_silu`` (csrc/weight_only_gemm.cc): a merged float32 gate/up projection and its
SwiGLU in one op, and ``CpuOps.linear_silu_and_mul``, which the unquantized linear method calls.

The kernel computes each gate and up sum with ``fd_f32_linear``'s loop and row blocks, so its
output is compared bit for bit with ``fd_silu_mul(fd_f32_linear(x, W))``: at 1-2 rows (two
accumulation chains), at row counts with a remainder block, and past one 96-row panel (the
kernel's unit of rows). Against float64 SwiGLU of the float64 product it is a float32 tolerance
(it is the SwiGLU of this product, not of another).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.builtin.cpu.kernels import load_kernels
from fastdeploy_core.builtin.cpu.ops import CpuOps


@pytest.fixture(scope="module")
def ops():
    if load_kernels() is None:
        pytest.skip("the cpu kernels cannot be built here")
    return CpuOps()


def case(seed: int, m: int, k: int, n: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    return x, w


def swiglu64(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    gate, up = np.split(x.astype(np.float64) @ w.astype(np.float64), 2, axis=-1)
    return gate / (1 + np.exp(-gate)) * up


@pytest.mark.parametrize(
    "m,k,n",
    # 1-2 rows (two chains), a block of 8 and a remainder, one panel and a part (129 rows), several
    # panels with a 1-row remainder block (257 = 32 x 8 + 1), K not a multiple of 16
    [(1, 64, 64), (2, 576, 128), (9, 100, 64), (17, 576, 192), (129, 576, 128), (257, 200, 64)],
)
def test_fused_swiglu_is_the_linear_then_silu_and_mul_bit_for_bit(ops, m, k, n):
    x, w = case(m * 31 + k + n, m, k, n)
    packed = ops.prepare_linear_weight(paddle.to_tensor(w))
    assert packed is not None and packed.ndim == 3
    fused = load_kernels().fd_f32_linear_silu(paddle.to_tensor(x), packed)
    assert fused.dtype == paddle.float32 and fused.shape == [m, n // 2]
    two_ops = ops.silu_and_mul(ops.linear(paddle.to_tensor(x), packed))
    np.testing.assert_array_equal(fused.numpy(), two_ops.numpy())
    np.testing.assert_allclose(fused.numpy(), swiglu64(x, w), rtol=1e-5, atol=1e-5)


def test_fused_swiglu_keeps_leading_axes_and_takes_no_rows(ops):
    x, w = case(3, 6, 64, 64)
    packed = ops.prepare_linear_weight(paddle.to_tensor(w))
    got = load_kernels().fd_f32_linear_silu(paddle.to_tensor(x.reshape(2, 3, 64)), packed)
    assert got.shape == [2, 3, 32]
    want = load_kernels().fd_f32_linear_silu(paddle.to_tensor(x), packed).numpy().reshape(2, 3, 32)
    np.testing.assert_array_equal(got.numpy(), want)
    empty = load_kernels().fd_f32_linear_silu(paddle.to_tensor(np.zeros((0, 64), np.float32)), packed)
    assert empty.shape == [0, 32]


def test_fused_swiglu_refuses_what_it_cannot_take(ops):
    x, w = case(5, 3, 64, 96)
    packed = ops.prepare_linear_weight(paddle.to_tensor(w))  # 3 tiles: no whole halves
    with pytest.raises(Exception, match="gate and up halves must be whole 32-column tiles"):
        load_kernels().fd_f32_linear_silu(paddle.to_tensor(x), packed)
    x, w = case(6, 3, 64, 64)
    packed = ops.prepare_linear_weight(paddle.to_tensor(w))
    with pytest.raises(Exception, match=r"x's last axis \(32\) must equal the weight's K \(64\)"):
        load_kernels().fd_f32_linear_silu(paddle.to_tensor(x[:, :32].copy()), packed)
    with pytest.raises(Exception, match="packed float32"):
        load_kernels().fd_f32_linear_silu(paddle.to_tensor(x), paddle.to_tensor(w))


@pytest.mark.parametrize("what", ["fused", "bias", "odd_tiles"])
def test_ops_fuse_the_swiglu_where_the_kernel_takes_it(ops, what, cpu_kernel_calls):
    """``CpuOps.linear_silu_and_mul`` gives the two ops' bits whichever way it goes: one kernel
    for a packed weight with whole-tile halves and no bias, else the two ops."""
    n = 96 if what == "odd_tiles" else 128
    x, w = case(11, 40, 576, n)
    packed = ops.prepare_linear_weight(paddle.to_tensor(w))
    b = paddle.to_tensor(np.random.default_rng(12).standard_normal(n).astype(np.float32)) if what == "bias" else None
    got = ops.linear_silu_and_mul(paddle.to_tensor(x), packed, b)
    assert cpu_kernel_calls == (["fd_f32_linear_silu"] if what == "fused" else ["fd_f32_linear", "fd_silu_mul"])
    want = ops.silu_and_mul(ops.linear(paddle.to_tensor(x), packed, b))
    np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_the_unquantized_gate_up_projection_runs_the_fused_kernel(ops, cpu_kernel_calls):
    """A float32 merged gate/up layer's ``forward_silu_and_mul`` on the cpu ops table is one
    kernel call, with the two ops' bits."""
    from fastdeploy_core.devices.current import current_ops, set_current_ops
    from fastdeploy_core.layers.linear import MergedColumnLinear

    previous = current_ops()
    set_current_ops(ops)
    try:
        layer = MergedColumnLinear(64, [96, 96], bias=False)
        x, w = case(21, 5, 64, 192)
        layer.weight.set_value(paddle.to_tensor(w))
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.weight.ndim == 3
        cpu_kernel_calls.clear()
        got = layer.forward_silu_and_mul(paddle.to_tensor(x))
        assert cpu_kernel_calls == ["fd_f32_linear_silu"]
        want = ops.silu_and_mul(ops.linear(paddle.to_tensor(x), layer.weight))
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    finally:
        set_current_ops(previous)
