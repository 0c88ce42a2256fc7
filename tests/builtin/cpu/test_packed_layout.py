"""The cpu device's packed weight layout: ``[N / 32, rows, 32]`` column tiles.

The cpu ops table repacks every linear weight (float32 and quantized storage) after loading
(:meth:`CpuOps.prepare_linear_weight`); the C++ kernels read either layout, chosen by rank.
These tests check that packing changes where the bytes are and nothing else.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.layers.linear import Linear
from fastdeploy_core.builtin.cpu.layout import pack_column_tiles, unpack_column_tiles
from fastdeploy_core.builtin.cpu.ops import CpuOps
from fastdeploy_core.quantization.fp8 import BlockWiseFP8, quantize_block_fp8
from fastdeploy_core.quantization.w4a8 import W4A8
from fastdeploy_core.quantization.w8a8 import W8A8
from fastdeploy_core.quantization.weight_only import WeightOnlyInt4, WeightOnlyInt8
from fastdeploy_core.quantization.codes import quantize_int4, quantize_int8


def gaussian(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_pack_and_unpack_are_inverse_for_every_storage_dtype():
    rng = np.random.default_rng(0)
    values = gaussian(rng, (48, 96))
    for tensor in (
        paddle.to_tensor(values),
        paddle.to_tensor((values * 10).astype(np.int8)),
        paddle.to_tensor((np.abs(values) * 10).astype(np.uint8)),
        paddle.to_tensor(values).astype(paddle.float8_e4m3fn),
    ):
        packed = pack_column_tiles(tensor)
        assert tuple(packed.shape) == (3, 48, 32) and packed.dtype == tensor.dtype
        # tile t, row r holds columns [32 t, 32 t + 32) of row r
        np.testing.assert_array_equal(
            packed.astype("float32").numpy()[2, 5], tensor.astype("float32").numpy()[5, 64:96]
        )
        np.testing.assert_array_equal(
            unpack_column_tiles(packed).astype("float32").numpy(), tensor.astype("float32").numpy()
        )
    plain = paddle.to_tensor(values)
    assert unpack_column_tiles(plain) is plain  # 2-D storage is already plain: passed through as is


def _storage(kind: str, rng, K: int, N: int, group: int):
    if kind == "int8":
        out = quantize_int8(gaussian(rng, (K, N)), group)
        return [paddle.to_tensor(out["weight"]), paddle.to_tensor(out["weight_scale"])]
    if kind == "int4":
        out = quantize_int4(gaussian(rng, (K, N)), group, True)
        return [paddle.to_tensor(out[k]) for k in ("weight", "weight_scale", "weight_offset")]
    out = quantize_block_fp8(gaussian(rng, (K, N)), (group, 128))
    return [paddle.to_tensor(out["weight"]).astype(paddle.float8_e4m3fn), paddle.to_tensor(out["weight_scale"])]


CASES = [
    ("int8", "wint8_linear", WeightOnlyInt8, 576),
    ("int8", "w8a8_linear", W8A8, 32),
    ("int4", "wint4_linear", WeightOnlyInt4, 32),
    ("int4", "w4a8_linear", W4A8, 128),
    ("fp8", "block_wise_fp8_linear", BlockWiseFP8, 128),
]


@pytest.mark.parametrize("rows", [1, 5, 8, 16, 37])
@pytest.mark.parametrize("case", CASES, ids=[c[1] for c in CASES])
def test_quantized_kernels_give_the_same_result_on_packed_storage(case, rows, cpu_kernels):
    kind, op_name, method_cls, group = case
    K, N = 576, 224  # 7 tiles of 32; a short last group for 128
    rng = np.random.default_rng(rows)
    storage = _storage(kind, rng, K, N, group)
    x = paddle.to_tensor(gaussian(rng, (rows, K)))
    op = getattr(CpuOps(), op_name)
    row_major = op(x, *storage, group).numpy()
    packed = op(x, pack_column_tiles(storage[0]), *storage[1:], group).numpy()
    # The same multiply-adds in the same order: bit-identical, not merely close.
    np.testing.assert_array_equal(packed, row_major)
    want = method_cls.reference_op(x, *storage, group).numpy()  # the formula reads the plain layout
    assert np.abs(packed - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("rows", [1, 3, 8, 16, 21, 64])
def test_float32_kernel_matches_matmul_in_both_layouts(rows, cpu_kernels):
    rng = np.random.default_rng(rows)
    K, N = 200, 96
    w = paddle.to_tensor(gaussian(rng, (K, N)))
    x = paddle.to_tensor(gaussian(rng, (rows, K)))
    want = paddle.matmul(x, w).numpy()
    row_major = cpu_kernels.fd_f32_linear(x, w).numpy()
    packed = cpu_kernels.fd_f32_linear(x, pack_column_tiles(w)).numpy()
    np.testing.assert_array_equal(packed, row_major)
    np.testing.assert_allclose(packed, want, rtol=1e-5, atol=1e-4)


def test_float32_kernel_takes_3d_input_and_rejects_a_wrong_k(cpu_kernels):
    rng = np.random.default_rng(3)
    w = pack_column_tiles(paddle.to_tensor(gaussian(rng, (64, 64))))
    x = paddle.to_tensor(gaussian(rng, (2, 3, 64)))
    assert tuple(cpu_kernels.fd_f32_linear(x, w).shape) == (2, 3, 64)
    with pytest.raises(Exception, match="must equal the weight's K"):
        cpu_kernels.fd_f32_linear(paddle.ones([2, 63]), w)


def _float_layer(rng, in_size: int, out_size: int, bias: bool) -> tuple[Linear, np.ndarray]:
    layer = Linear(in_size, out_size, bias=bias, prefix="model.layers.0.mlp.down_proj")
    checkpoint = gaussian(rng, (out_size, in_size))  # HF [out, in]
    layer.weight.weight_loader(layer.weight, checkpoint)
    if bias:
        layer.bias.weight_loader(layer.bias, gaussian(rng, (out_size,)))
    return layer, checkpoint


def test_cpu_ops_pack_float_linear_layers_and_keep_their_output(cpu_kernels):
    rng = np.random.default_rng(7)
    set_current_ops(CpuOps())
    layer, checkpoint = _float_layer(rng, 96, 128, bias=True)
    x = paddle.to_tensor(gaussian(rng, (5, 96)))
    before = paddle.matmul(x, paddle.to_tensor(np.ascontiguousarray(checkpoint.T))).numpy() + layer.bias.numpy()
    layer.quant_method.process_weights_after_loading(layer)
    assert tuple(layer.weight.shape) == (4, 96, 32)
    assert [name for name, _ in layer.named_parameters()] == ["weight", "bias"]
    np.testing.assert_allclose(layer(x).numpy(), before, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(unpack_column_tiles(layer.weight).numpy(), checkpoint.T)
    layer.quant_method.process_weights_after_loading(layer)  # a second call leaves it packed once
    assert tuple(layer.weight.shape) == (4, 96, 32)


def test_widths_that_are_not_whole_tiles_and_other_devices_keep_the_plain_layout(cpu_kernels):
    rng = np.random.default_rng(8)
    set_current_ops(CpuOps())
    odd, _ = _float_layer(rng, 64, 100, bias=False)
    odd.quant_method.process_weights_after_loading(odd)
    assert tuple(odd.weight.shape) == (64, 100)
    set_current_ops(ReferenceOps())
    plain, _ = _float_layer(rng, 64, 128, bias=False)
    plain.quant_method.process_weights_after_loading(plain)
    assert tuple(plain.weight.shape) == (64, 128)


@pytest.mark.parametrize("quantizer", [WeightOnlyInt8(), WeightOnlyInt4({"group_size": 32}), BlockWiseFP8()])
def test_quantized_layers_pack_their_weight_storage_and_dequantize_the_same(quantizer, cpu_kernels):
    rng = np.random.default_rng(9)
    set_current_ops(CpuOps())
    layer = Linear(256, 128, quant_config=quantizer, prefix="model.layers.0.mlp.down_proj")
    layer.weight.weight_loader(layer.weight, gaussian(rng, (128, 256)))
    x = paddle.to_tensor(gaussian(rng, (3, 256)))
    rows = int(layer.weight.shape[0])
    dequantized = quantizer.dequantize(layer).numpy()
    before = layer(x).numpy()
    quantizer.process_weights_after_loading(layer)
    np.testing.assert_array_equal(quantizer.dequantize(layer).numpy(), dequantized)
    if isinstance(quantizer, WeightOnlyInt4) and CpuOps.int4_vnni_layout:
        # int4 on a VNNI cpu: [N / 32, K / 8, 32, 4] codes, [N / 32, G, 32] scales and offsets,
        # and integer dot products (activations to 16 bits per block of 32): close, not identical.
        assert tuple(layer.weight.shape) == (4, 32, 32, 4)
        assert tuple(layer.weight_scale.shape) == tuple(layer.weight_offset.shape) == (4, 8, 32)
        after = layer(x).numpy()
        assert np.abs(after - before).max() <= 1e-4 * np.abs(before).max()
    elif isinstance(quantizer, WeightOnlyInt8) and CpuOps.wint8_int_dot:
        # per-channel int8 with integer dot products: [N / 32, K / 4, 32, 4] quads, the scales as
        # they were, activations to 16 bits per row (test_w8a8_int_dot.py): close, not identical.
        assert tuple(layer.weight.shape) == (4, 64, 32, 4) and tuple(layer.weight_scale.shape) == (1, 128)
        after = layer(x).numpy()
        assert np.abs(after - before).max() <= 1e-4 * np.abs(before).max()
    else:
        assert tuple(layer.weight.shape) == (4, rows, 32)
        np.testing.assert_array_equal(layer(x).numpy(), before)
