"""Quantization methods: round-trip error bounds, layer outputs vs float, kernels vs reference formulas.

The C++ kernels are built once per machine into the kernel cache (the first run of this
module on a fresh machine takes ~20-40 s for that) and loaded from there afterwards.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.builtin.cpu.device import CpuDevice
from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.layers.linear import Linear, MergedColumnLinear, QKVLinear
from fastdeploy_core.builtin.cpu.ops import CpuOps
from fastdeploy_core.quantization.fp8 import BlockWiseFP8, quantize_block_fp8
from fastdeploy_core.quantization.w4a8 import W4A8
from fastdeploy_core.quantization.w8a8 import W8A8
from fastdeploy_core.quantization.weight_only import WeightOnlyInt4, WeightOnlyInt8, int4_weight, int8_weight
from fastdeploy_core.quantization.codes import quantize_int4, quantize_int8

METHODS = {
    "wint8": lambda: WeightOnlyInt8(),
    "wint8_g64": lambda: WeightOnlyInt8({"group_size": 64}),
    "wint4": lambda: WeightOnlyInt4(),
    "wint4_sym_g32": lambda: WeightOnlyInt4({"group_size": 32, "has_zero_point": False}),
    "w8a8": lambda: W8A8(),
    "w4a8": lambda: W4A8(),
    "block_wise_fp8": lambda: BlockWiseFP8(),
}


def rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def gaussian(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("group_size", [None, 32, 128])
def test_int8_round_trip_is_within_half_a_step(group_size):
    rng = np.random.default_rng(0)
    w = gaussian(rng, (576, 96))
    w[:, 3] = 0.0  # an all-zero column must not divide by zero
    gs = group_size or 576
    out = quantize_int8(w, gs)
    assert out["weight"].dtype == np.int8 and out["weight_scale"].shape == (-(-576 // gs), 96)
    assert np.abs(out["weight"]).max() <= 127
    deq = int8_weight(paddle.to_tensor(out["weight"]), paddle.to_tensor(out["weight_scale"]), gs).numpy()
    step = np.repeat(out["weight_scale"], gs, axis=0)[:576]
    assert np.all(np.abs(deq - w) <= 0.5 * step * (1 + 1e-5) + 1e-7)
    assert np.all(deq[:, 3] == 0)
    # the bound is tight: the error really reaches close to half a step somewhere
    assert np.max(np.abs(deq - w) / step) > 0.45


@pytest.mark.parametrize("has_zero_point", [True, False])
@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_round_trip_is_within_half_a_step(has_zero_point, group_size):
    rng = np.random.default_rng(1)
    w = gaussian(rng, (576, 64)) + 0.3  # off-centre: the zero point helps
    out = quantize_int4(w, group_size, has_zero_point)
    assert out["weight"].dtype == np.uint8 and out["weight"].shape == (288, 64)
    groups = -(-576 // group_size)  # 576 / 128 -> 5 groups, the last of 64 rows
    assert out["weight_scale"].shape == out["weight_offset"].shape == (groups, 64)
    deq = int4_weight(
        paddle.to_tensor(out["weight"]),
        paddle.to_tensor(out["weight_scale"]),
        paddle.to_tensor(out["weight_offset"]),
        group_size,
    ).numpy()
    step = np.repeat(out["weight_scale"], group_size, axis=0)[:576]
    assert np.all(np.abs(deq - w) <= 0.5 * step * (1 + 1e-4) + 1e-6)
    if not has_zero_point:
        np.testing.assert_allclose(out["weight_offset"], -8 * out["weight_scale"], rtol=1e-6)


def test_asymmetric_int4_beats_symmetric_on_shifted_weights():
    rng = np.random.default_rng(2)
    w = gaussian(rng, (256, 64)) + 1.0
    errs = []
    for zp in (True, False):
        out = quantize_int4(w, 32, zp)
        deq = int4_weight(*(paddle.to_tensor(out[k]) for k in ("weight", "weight_scale", "weight_offset")), 32).numpy()
        errs.append(np.abs(deq - w).mean())
    assert errs[0] < 0.8 * errs[1]


def test_fp8_round_trip_has_e4m3_precision_and_real_fp8_storage():
    rng = np.random.default_rng(3)
    w = gaussian(rng, (300, 200)) * np.exp(gaussian(rng, (300, 200)))  # wide dynamic range
    out = quantize_block_fp8(w, (128, 128))
    assert out["weight_scale"].shape == (3, 200)
    # one scale per 128 x 128 block: columns 0..127 share it, 128..199 share another
    assert np.all(out["weight_scale"][:, :128] == out["weight_scale"][:, :1])
    assert np.all(out["weight_scale"][:, 128:] == out["weight_scale"][:, 128:129])
    stored = paddle.to_tensor(out["weight"]).astype(paddle.float8_e4m3fn)
    assert stored.dtype == paddle.float8_e4m3fn and stored.element_size() == 1
    deq = (stored.astype("float32").numpy()) * np.repeat(out["weight_scale"], 128, axis=0)[:300]
    scale_rows = np.repeat(out["weight_scale"], 128, axis=0)[:300]
    normal = np.abs(w) >= scale_rows * 2.0**-6
    # e4m3 keeps 3 mantissa bits: relative rounding error at most 2^-4 for normal values
    assert np.all(np.abs(deq - w)[normal] <= np.abs(w)[normal] * 2.0**-4 * (1 + 1e-6))
    # subnormals are spaced 2^-9 (times the block scale)
    assert np.all(np.abs(deq - w)[~normal] <= scale_rows[~normal] * 2.0**-10 * (1 + 1e-6))
    assert np.abs(stored.astype("float32").numpy()).max() <= 448.0


# ---- layers -------------------------------------------------------------------------------------
def _load_qkv(quantizer, rng, hidden=256, head_dim=32, heads=8, kv_heads=2, bias=False):
    layer = QKVLinear(hidden, head_dim, heads, kv_heads, bias=bias, quant_config=quantizer, prefix="l.qkv_proj")
    floats = QKVLinear(hidden, head_dim, heads, kv_heads, bias=bias, prefix="l.qkv_proj")
    for shard, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
        w = gaussian(rng, (rows, hidden), 1 / np.sqrt(hidden))
        for target in (layer, floats):
            target.weight.weight_loader(target.weight, w, shard)
            if bias:
                b = gaussian(np.random.default_rng(rows), (rows,), 0.1)
                target.bias.weight_loader(target.bias, b, shard)
    return layer, floats


#: Largest relative error of the quantized Q/K/V layer against the float layer, on the inputs of
#: the test below (seeds 4 and 5). Measured on 2026-12-02 with Paddle 3.3.1's CPU build, the same
#: for the reference ops and the cpu kernels: block_wise_fp8 0.02305, w4a8 0.11203, w8a8 0.00891,
#: wint4 0.10575, wint4_sym_g32 0.09964, wint8 0.00584, wint8_g64 0.00577. Each bound is about 8%
#: above its measurement, so a method that loses precision (a coarser group, a code step too
#: wide, an offset dropped) fails here; the classes' own ``expected_error`` is the looser promise
#: the conformance kit holds a chip to.
ERROR_BOUNDS = {
    "block_wise_fp8": 0.025,
    "w4a8": 0.121,
    "w8a8": 0.0097,
    "wint4": 0.114,
    "wint4_sym_g32": 0.108,
    "wint8": 0.0063,
    "wint8_g64": 0.0062,
}


@pytest.mark.parametrize("name", sorted(METHODS))
@pytest.mark.parametrize("ops_cls", [ReferenceOps, CpuOps], ids=["reference", "kernels"])
def test_quantized_layer_is_close_to_the_float_layer(name, ops_cls, cpu_kernels):
    quantizer = METHODS[name]()
    assert ERROR_BOUNDS[name] <= quantizer.expected_error, "the class promises less than the method measures"
    layer, floats = _load_qkv(quantizer, np.random.default_rng(4), bias=True)
    assert layer.quant_method is quantizer
    x = paddle.to_tensor(gaussian(np.random.default_rng(5), (7, 256)))
    set_current_ops(ops_cls())
    y = layer(x).numpy()
    y_float = floats(x).numpy()
    err = rel(y, y_float)
    assert err <= ERROR_BOUNDS[name], f"{name}: relative error {err:.5f}, measured bound {ERROR_BOUNDS[name]}"
    assert err > 1e-5, "a quantized layer that equals the float layer did not quantize"


@pytest.mark.parametrize("name", sorted(METHODS))
def test_storage_is_compact(name):
    quantizer = METHODS[name]()
    layer = Linear(512, 384, quant_config=quantizer, prefix="l.down_proj")
    floats = Linear(512, 384, prefix="l.down_proj")
    K, N = 512, 384
    expected = {
        "wint8": K * N + 4 * N,  # int8 codes + one float32 scale per output channel
        "w8a8": K * N + 4 * N,
        "wint8_g64": K * N + 4 * N * (K // 64),
        "wint4": K * N // 2 + 2 * 4 * N * (K // 128),  # packed nibbles + scale and offset per group
        "w4a8": K * N // 2 + 2 * 4 * N * (K // 128),
        "wint4_sym_g32": K * N // 2 + 2 * 4 * N * (K // 32),
        "block_wise_fp8": K * N + 4 * N * (K // 128),  # e4m3 bytes + block scales repeated per column
    }
    assert quantizer.storage_bytes(layer) == expected[name]
    assert quantizer.storage_bytes(layer) <= 0.27 * K * N * 4
    assert [n for n, _ in floats.named_parameters()] == ["weight"]


def test_merged_shards_quantize_like_separate_layers():
    """Per-channel scales: loading q, k, v shard by shard gives each shard its own columns' codes."""
    rng = np.random.default_rng(6)
    quantizer = WeightOnlyInt8()
    layer = MergedColumnLinear(64, [48, 16], quant_config=quantizer, prefix="m.gate_up_proj")
    shards = [gaussian(rng, (48, 64)), gaussian(rng, (16, 64)) * 10]
    for i, w in enumerate(shards):
        layer.weight.weight_loader(layer.weight, w, i)
    whole = quantize_int8(np.concatenate(shards).T, 64)
    np.testing.assert_array_equal(layer.weight.numpy(), whole["weight"])
    np.testing.assert_allclose(layer.weight_scale.numpy(), whole["weight_scale"], rtol=1e-6)


def test_fp8_blocks_do_not_straddle_shards():
    rng = np.random.default_rng(7)
    quantizer = BlockWiseFP8()
    layer = MergedColumnLinear(128, [96, 32], quant_config=quantizer, prefix="m.gate_up_proj")
    small, big = gaussian(rng, (96, 128)), gaussian(rng, (32, 128)) * 100
    layer.weight.weight_loader(layer.weight, small, 0)
    layer.weight.weight_loader(layer.weight, big, 1)
    scale = layer.weight_scale.numpy()
    assert np.allclose(scale[0, :96], np.abs(small).max() / 448, rtol=1e-6)
    assert np.allclose(scale[0, 96:], np.abs(big).max() / 448, rtol=1e-6)
    deq = quantizer.dequantize(layer).numpy()
    assert rel(deq[:, :96], small.T) < 0.07 and rel(deq[:, 96:], big.T) < 0.07


def test_pre_quantized_checkpoint_tensors_load_as_stored():
    rng = np.random.default_rng(8)
    quantizer = WeightOnlyInt8({"is_quantized": True})
    layer = Linear(64, 32, quant_config=quantizer, prefix="p.o_proj")
    # checkpoint orientation: weight [out, in] int8, weight_scale [out]
    codes = rng.integers(-127, 128, (32, 64)).astype(np.int8)
    scale = rng.random(32).astype(np.float32)
    params = dict(layer.named_parameters())
    assert set(params) == {"weight", "weight_scale"}  # the scale is a checkpoint tensor here
    params["weight"].weight_loader(params["weight"], codes)
    params["weight_scale"].weight_loader(params["weight_scale"], scale)
    np.testing.assert_array_equal(layer.weight.numpy(), codes.T)
    x = gaussian(rng, (3, 64))
    set_current_ops(ReferenceOps())
    np.testing.assert_allclose(layer(paddle.to_tensor(x)).numpy(), x @ (codes.T * scale), rtol=1e-5, atol=1e-4)


def test_wrong_shapes_are_reported_by_layer_name():
    layer = Linear(64, 32, quant_config=WeightOnlyInt8(), prefix="model.layers.3.mlp.down_proj")
    with pytest.raises(ModelLoadError, match=r"model.layers.3.mlp.down_proj.*\(32, 65\)"):
        layer.weight.weight_loader(layer.weight, np.zeros((32, 65), np.float32))


def test_modules_to_not_convert_keeps_layers_float():
    quantizer = WeightOnlyInt8({"modules_to_not_convert": ["*.o_proj", "layers.1."]})
    assert quantizer.get_quant_method(None, "model.layers.0.self_attn.o_proj") is None
    assert quantizer.get_quant_method(None, "model.layers.1.mlp.down_proj") is None
    assert quantizer.get_quant_method(None, "model.layers.0.mlp.down_proj") is quantizer
    layer = Linear(64, 32, quant_config=quantizer, prefix="model.layers.0.self_attn.o_proj")
    assert layer.weight.dtype == paddle.float32


# ---- kernels ------------------------------------------------------------------------------------
def _inputs(rng, kind: str, K: int, N: int, group: int):
    if kind == "int8":
        out = quantize_int8(gaussian(rng, (K, N)), group)
        return (paddle.to_tensor(out["weight"]), paddle.to_tensor(out["weight_scale"]))
    if kind == "int4":
        out = quantize_int4(gaussian(rng, (K, N)), group, True)
        return tuple(paddle.to_tensor(out[k]) for k in ("weight", "weight_scale", "weight_offset"))
    out = quantize_block_fp8(gaussian(rng, (K, N)), (group, 128))
    return (paddle.to_tensor(out["weight"]).astype(paddle.float8_e4m3fn), paddle.to_tensor(out["weight_scale"]))


KERNEL_CASES = [
    # kind, op, act_int8, reference method, group
    ("int8", "wint8_linear", WeightOnlyInt8, None),
    ("int8", "wint8_linear", WeightOnlyInt8, 32),
    ("int8", "w8a8_linear", W8A8, None),
    ("int4", "wint4_linear", WeightOnlyInt4, 128),
    ("int4", "w4a8_linear", W4A8, 32),
    ("fp8", "block_wise_fp8_linear", BlockWiseFP8, 128),
]


@pytest.mark.parametrize("rows", [1, 3, 4, 9, 37])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[f"{c[1]}-g{c[3]}" for c in KERNEL_CASES])
def test_kernel_matches_reference_formula(case, rows, cpu_kernels):
    kind, op_name, method_cls, group = case
    K, N = 576, 200  # a short last group (576 = 4 * 128 + 64) and 8 tail columns past 6 tiles of 32
    rng = np.random.default_rng(rows)
    group = group or K
    storage = _inputs(rng, kind, K, N, group)
    x = paddle.to_tensor(gaussian(rng, (rows, K)))
    bias = paddle.to_tensor(gaussian(rng, (N,)))
    got = getattr(CpuOps(), op_name)(x, *storage, group, bias).numpy()
    want = method_cls.reference_op(x, *storage, group, bias).numpy()
    assert got.shape == (rows, N)
    assert rel(got, want) <= 1e-4


def test_kernel_accepts_3d_input_and_noncontiguous_rows(cpu_kernels):
    rng = np.random.default_rng(9)
    out = quantize_int8(gaussian(rng, (64, 96)), 64)
    w, s = paddle.to_tensor(out["weight"]), paddle.to_tensor(out["weight_scale"])
    x = paddle.to_tensor(gaussian(rng, (2, 5, 128)))[:, :, ::2]  # a strided view
    got = cpu_kernels.fd_int8_linear(x, w, s, 64, False).numpy()
    want = WeightOnlyInt8.reference_op(x, w, s, 64).numpy()
    assert got.shape == (2, 5, 96) and rel(got, want) <= 1e-4


def test_kernel_rejects_mismatched_shapes(cpu_kernels):
    w = paddle.zeros([64, 32], dtype="int8")
    s = paddle.ones([1, 32])
    with pytest.raises(Exception, match="must equal the weight's K"):
        cpu_kernels.fd_int8_linear(paddle.ones([2, 63]), w, s, 64, False)
    with pytest.raises(Exception, match="groups"):
        cpu_kernels.fd_int8_linear(paddle.ones([2, 64]), w, s, 32, False)


def test_fp8_kernel_decodes_every_e4m3_value_exactly(cpu_kernels):
    """All 254 finite e4m3fn bit patterns (incl. subnormals and -0) widen exactly."""
    codes = np.array([b for b in range(256) if (b & 0x7F) != 0x7F], dtype=np.uint8)  # drop the NaNs
    K = len(codes)
    weight = paddle.to_tensor(np.tile(codes[:, None], (1, 32))).view(paddle.float8_e4m3fn)  # one full tile
    as_float = weight.astype("float32").numpy()[:, 0]
    assert np.isfinite(as_float).all() and as_float.max() == 448.0 and as_float[1] == 2.0**-9
    eye = paddle.eye(K)
    got = cpu_kernels.fd_fp8_linear(eye, weight, paddle.ones([1, 32]), K).numpy()
    np.testing.assert_array_equal(got[:, 0], as_float)


def test_cpu_device_runs_the_kernels():
    ops = CpuDevice.make_ops()
    assert isinstance(ops, CpuOps) and isinstance(ops, ReferenceOps)
    assert {"wint8", "wint4", "w8a8", "w4a8", "block_wise_fp8"} <= set(CpuDevice.quantization_methods)


@pytest.mark.parametrize("env", [{"FD_CPU_KERNELS": "0"}, {"FD_DISABLE_QUANT_KERNELS": "1"}])
def test_without_kernels_the_cpu_ops_run_the_reference_formula(env):
    """FD_CPU_KERNELS=0 (its former name too, or a failed build) falls back to plain Paddle, and says why once."""
    from tests.core.fake_dists import run_python

    code = """
import logging, numpy as np, paddle
logging.basicConfig(level=logging.WARNING)
from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.layers.linear import Linear
from fastdeploy_core.builtin.cpu.ops import CpuOps
from fastdeploy_core.builtin.cpu.kernels import kernel_failure
from fastdeploy_core.quantization.weight_only import WeightOnlyInt8
set_current_ops(CpuOps())
layer = Linear(64, 32, quant_config=WeightOnlyInt8(), prefix="x.o_proj")
layer.weight.weight_loader(layer.weight, np.random.default_rng(0).standard_normal((32, 64)).astype("float32"))
x = paddle.ones([2, 64])
y = layer(x); y = layer(x)
want = WeightOnlyInt8.reference_op(x, layer.weight, layer.weight_scale, 64)
print("RESULT", float(paddle.abs(y - want).max()), kernel_failure())
"""
    backup = {name: os.environ.pop(name, None) for name in ("FD_CPU_KERNELS", "FD_DISABLE_QUANT_KERNELS")}
    os.environ.update(env)
    try:
        proc = run_python(code)
    finally:
        for name, value in backup.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert line == "RESULT 0.0 RuntimeError: FD_CPU_KERNELS=0 is set", line
    assert proc.stderr.count("cpu kernels unavailable") == 1
