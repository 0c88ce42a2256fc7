"""The int4 VNNI layout ``[N / 32, K / 8, 32, 4]`` and ``fd_int4_linear``'s integer-dot-product path.

On a CPU with integer dot products (AVX-512 VNNI, or AVX2) the cpu ops store int4 weights this
way (and their scales and offsets as ``[N / 32, G, 32]`` column tiles); the kernel then
multiplies 4-bit codes with 16-bit activation pieces through ``vpdpbusd`` (AVX-512 VNNI) or
``vpmaddubsw`` (AVX2, up to 8 rows; more rows widen each tile to float32 weights once and run the
float32 tiles). On other builds the same layout runs a scalar loop, so these tests run
everywhere; rows 1, 3 and 8 take the integer path on an AVX2 CPU, 17 the widened one.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.layers.linear import Linear
from fastdeploy_core.builtin.cpu.layout import (
    pack_column_tiles,
    pack_int4_vnni_tiles,
    unpack_column_tiles,
    unpack_int4_vnni_tiles,
)
from fastdeploy_core.builtin.cpu.ops import CpuOps
from fastdeploy_core.quantization.w4a8 import W4A8
from fastdeploy_core.quantization.weight_only import WeightOnlyInt4, int4_codes, int4_linear_reference
from fastdeploy_core.quantization.codes import pack_int4, quantize_int4


def gaussian(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def rel(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("shape", [(8, 32), (64, 96), (576, 224), (1536, 64)])
def test_vnni_packing_is_an_exact_inverse_and_puts_each_code_where_the_kernel_reads_it(shape):
    K, N = shape
    rng = np.random.default_rng(K + N)
    codes = rng.integers(0, 16, (K, N)).astype(np.uint8)
    storage = paddle.to_tensor(pack_int4(codes))
    packed = pack_int4_vnni_tiles(storage)
    assert tuple(packed.shape) == (N // 32, K // 8, 32, 4) and packed.dtype == paddle.uint8
    np.testing.assert_array_equal(unpack_int4_vnni_tiles(packed).numpy(), storage.numpy())
    np.testing.assert_array_equal(unpack_column_tiles(packed).numpy(), storage.numpy())
    np.testing.assert_array_equal(int4_codes(unpack_column_tiles(packed)).numpy(), codes.astype(np.float32))
    # byte [t, c, n, j]: q[8c + j, 32t + n] low nibble, q[8c + 4 + j, 32t + n] high nibble
    raw = packed.numpy()
    for t, c, n, j in [(0, 0, 0, 0), (N // 32 - 1, K // 8 - 1, 31, 3), (N // 32 // 2, K // 16, 17, 2)]:
        assert raw[t, c, n, j] & 15 == codes[8 * c + j, 32 * t + n]
        assert raw[t, c, n, j] >> 4 == codes[8 * c + 4 + j, 32 * t + n]


def test_vnni_packing_rejects_shapes_it_cannot_hold():
    with pytest.raises(ValueError, match="K % 8"):
        pack_int4_vnni_tiles(paddle.zeros([3, 32], dtype="uint8"))  # K = 6
    with pytest.raises(ValueError, match="N % 32"):
        pack_int4_vnni_tiles(paddle.zeros([4, 48], dtype="uint8"))


def _int4(rng, K, N, group, zero_point=True, scale_by=1.0):
    out = quantize_int4(gaussian(rng, (K, N)) * scale_by + 0.3, group, zero_point)
    return [paddle.to_tensor(out[k]) for k in ("weight", "weight_scale", "weight_offset")]


# K, N, group: groups of 32 (GGUF Q4), 128 with a short last group (576 = 4 * 128 + 64), 64 and
# 2048 (the blocks-of-32 loop), 48 and K = 584 (a last group of 8; the general loop), and 6
# (not a multiple of 8: the scalar loop over the same layout).
SHAPES = [
    (576, 960, 32),
    (576, 224, 128),
    (1536, 96, 32),
    (256, 64, 64),
    (96, 64, 48),
    (584, 64, 32),
    (4096, 32, 2048),
    (48, 64, 6),
]


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{k}x{n}-g{g}" for k, n, g in SHAPES])
@pytest.mark.parametrize("scales", ["GN", "tiled", "tiled-fp16"])
def test_vnni_kernel_matches_the_weight_only_reference(shape, rows, scales, cpu_kernels):
    K, N, group = shape
    rng = np.random.default_rng(rows * 1000 + K)
    w, scale, offset = _int4(rng, K, N, group)
    if scales == "tiled-fp16":  # values float16 holds exactly (GGUF's d and m)
        scale, offset = scale.astype("float16").astype("float32"), offset.astype("float16").astype("float32")
    x = paddle.to_tensor(gaussian(rng, (rows, K)))
    want = int4_linear_reference(x, w, scale, offset, group).numpy()
    s, o = scale, offset
    if scales != "GN":
        dtype = "float16" if scales == "tiled-fp16" else "float32"
        s, o = pack_column_tiles(scale.astype(dtype)), pack_column_tiles(offset.astype(dtype))
        # the tiled (float16) scales hand back to the reference formula unchanged
        plain = CpuOps().unprepare_linear_weight
        np.testing.assert_array_equal(int4_linear_reference(x, w, plain(s), plain(o), group).numpy(), want)
    got = cpu_kernels.fd_int4_linear(x, pack_int4_vnni_tiles(w), s, o, group, False).numpy()
    assert got.shape == (rows, N)
    # 16-bit activations per block: measured ~2-4e-5 of the largest output; the float kernel ~1e-6.
    assert rel(got, want) <= 6e-5, rel(got, want)


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize("zero_point", [False, True], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("group", [32, 128, 48])
def test_vnni_kernel_with_int8_activations_matches_w4a8(rows, zero_point, group, cpu_kernels):
    K, N = 576, 224
    rng = np.random.default_rng(rows)
    w, scale, offset = _int4(rng, K, N, group, zero_point)
    x = paddle.to_tensor(gaussian(rng, (rows, K)))
    want = int4_linear_reference(x, w, scale, offset, group, act_int8=True).numpy()
    got = cpu_kernels.fd_int4_linear(x, pack_int4_vnni_tiles(w), scale, offset, group, True).numpy()
    assert rel(got, want) <= 2e-6  # integer products exact, float sums


def test_vnni_kernel_keeps_small_activations_next_to_a_large_one(cpu_kernels):
    """Activation outliers (a few channels 100x the rest, as in LLM hidden states) cost only
    their own block of 32 its resolution: the error stays at the 16-bit level."""
    K, N, group = 576, 128, 32
    rng = np.random.default_rng(11)
    w, scale, offset = _int4(rng, K, N, group)
    x = gaussian(rng, (2, K))
    x[:, 5] *= 300.0
    x[:, 300] *= -150.0
    x = paddle.to_tensor(x)
    want = int4_linear_reference(x, w, scale, offset, group).numpy()
    got = cpu_kernels.fd_int4_linear(x, pack_int4_vnni_tiles(w), scale, offset, group, False).numpy()
    assert rel(got, want) <= 6e-5


def test_vnni_kernel_handles_zero_rows_and_checks_shapes(cpu_kernels):
    rng = np.random.default_rng(3)
    w, scale, offset = _int4(rng, 64, 32, 32)
    packed = pack_int4_vnni_tiles(w)
    x = paddle.zeros([2, 64])
    np.testing.assert_array_equal(cpu_kernels.fd_int4_linear(x, packed, scale, offset, 32, False).numpy(), 0.0)
    assert tuple(cpu_kernels.fd_int4_linear(paddle.ones([2, 3, 64]), packed, scale, offset, 32, False).shape) == (2, 3, 32)
    with pytest.raises(Exception, match="must equal the weight's K"):
        cpu_kernels.fd_int4_linear(paddle.ones([2, 56]), packed, scale, offset, 32, False)
    with pytest.raises(Exception, match="groups"):
        cpu_kernels.fd_int4_linear(paddle.ones([2, 64]), packed, scale, offset, 16, False)


@pytest.mark.parametrize(
    "quantizer", [WeightOnlyInt4({"group_size": 32}), WeightOnlyInt4(), W4A8()], ids=["wint4-g32", "wint4-g128", "w4a8"]
)
def test_int4_layers_take_the_vnni_layout_and_keep_their_weights(quantizer, cpu_kernels, monkeypatch):
    monkeypatch.setattr(CpuOps, "int4_vnni_layout", True)  # the layout works on any build
    rng = np.random.default_rng(12)
    set_current_ops(CpuOps())
    layer = Linear(384, 96, quant_config=quantizer, prefix="model.layers.0.mlp.down_proj")
    layer.weight.weight_loader(layer.weight, gaussian(rng, (96, 384)))
    x = paddle.to_tensor(gaussian(rng, (5, 384)))
    dequantized = quantizer.dequantize(layer).numpy()
    want = quantizer.reference_op(x, *quantizer.op_args(layer)).numpy()
    groups = -(-384 // quantizer.config.group_size)
    quantizer.process_weights_after_loading(layer)
    assert tuple(layer.weight.shape) == (3, 48, 32, 4)
    assert tuple(layer.weight_scale.shape) == tuple(layer.weight_offset.shape) == (3, groups, 32)
    np.testing.assert_array_equal(quantizer.dequantize(layer).numpy(), dequantized)
    assert rel(layer(x).numpy(), want) <= 6e-5
    quantizer.process_weights_after_loading(layer)  # a second call leaves it as it is
    assert tuple(layer.weight.shape) == (3, 48, 32, 4)
    assert tuple(layer.weight_scale.shape) == (3, groups, 32)
    # the reference formula reads the packed storage handed back by the ops table
    assert rel(quantizer.reference_op(x, *quantizer.reference_args(layer)).numpy(), want) <= 1e-6


def test_int4_scales_are_stored_as_float16_only_when_that_is_exact(cpu_kernels, monkeypatch):
    monkeypatch.setattr(CpuOps, "int4_vnni_layout", True)
    set_current_ops(CpuOps())
    rng = np.random.default_rng(14)
    quantizer = WeightOnlyInt4({"group_size": 32})
    for exact in (True, False):
        layer = Linear(64, 64, quant_config=quantizer, prefix="model.layers.0.mlp.down_proj")
        layer.weight.weight_loader(layer.weight, gaussian(rng, (64, 64)))
        if exact:  # as a GGUF Q4_1 tensor loads: float16 d and m
            for name in ("weight_scale", "weight_offset"):
                getattr(layer, name).set_value(getattr(layer, name).astype("float16").astype("float32"))
        x = paddle.to_tensor(gaussian(rng, (2, 64)))
        want = quantizer.reference_op(x, *quantizer.op_args(layer)).numpy()
        dequantized = quantizer.dequantize(layer).numpy()
        quantizer.process_weights_after_loading(layer)
        assert layer.weight_scale.dtype == layer.weight_offset.dtype == (paddle.float16 if exact else paddle.float32)
        np.testing.assert_array_equal(quantizer.dequantize(layer).numpy(), dequantized)
        assert rel(layer(x).numpy(), want) <= 6e-5


def test_int4_keeps_the_float_kernel_layout_without_vnni_or_when_k_is_not_a_multiple_of_8(cpu_kernels, monkeypatch):
    rng = np.random.default_rng(13)
    set_current_ops(CpuOps())
    monkeypatch.setattr(CpuOps, "int4_vnni_layout", False)
    layer = Linear(128, 64, quant_config=WeightOnlyInt4({"group_size": 32}), prefix="model.layers.0.mlp.down_proj")
    layer.weight.weight_loader(layer.weight, gaussian(rng, (64, 128)))
    layer.quant_method.process_weights_after_loading(layer)
    assert tuple(layer.weight.shape) == (2, 64, 32) and tuple(layer.weight_scale.shape) == (4, 64)
    monkeypatch.setattr(CpuOps, "int4_vnni_layout", True)
    odd = Linear(36, 64, quant_config=WeightOnlyInt4({"group_size": 12}), prefix="model.layers.0.mlp.down_proj")
    odd.weight.weight_loader(odd.weight, gaussian(rng, (64, 36)))
    odd.quant_method.process_weights_after_loading(odd)
    assert tuple(odd.weight.shape) == (2, 18, 32)
