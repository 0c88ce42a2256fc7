"""``--dtype bfloat16``'s linear method (quantization/bfloat16.py) at the layer level, on the
reference ops and on the cpu ops: storage rounded to nearest even, shards into their columns,
the device layout and back, the LM head included, mixture-of-experts refused."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fastdeploy_core.builtin.cpu.ops import CpuOps
from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.devices.reference_ops import ReferenceOps, bf16_linear_reference
from fastdeploy_core.errors import ConfigError
from fastdeploy_core.layers.embedding import LMHead
from fastdeploy_core.layers.linear import QKVLinear
from fastdeploy_core.layers.moe import FusedMoE
from fastdeploy_core.quantization.bfloat16 import BFloat16Linear
from fastdeploy_core.quantization.codes import bfloat16_bits


def _bits(tensor: paddle.Tensor) -> np.ndarray:
    return tensor.view(paddle.uint16).numpy()


@pytest.mark.parametrize("ops_class", [ReferenceOps, CpuOps])
def test_qkv_shards_load_rounded_and_run_the_formula(ops_class, restore_ops):
    ops = ops_class()
    set_current_ops(ops)
    rng = np.random.default_rng(0)
    layer = QKVLinear(64, 16, 4, 2, bias=True, quant_config=BFloat16Linear(), prefix="model.layers.0.self_attn.qkv_proj")
    assert layer.weight.dtype == paddle.bfloat16 and layer.weight.shape == [64, 128]
    shards = {}
    for shard, rows in (("q", 64), ("k", 32), ("v", 32)):
        shards[shard] = rng.standard_normal((rows, 64)).astype(np.float32)
        layer.weight.weight_loader(layer.weight, shards[shard], shard)
        layer.bias.weight_loader(layer.bias, np.full(rows, 0.5, np.float32), shard)
    full = np.concatenate([shards["q"], shards["k"], shards["v"]]).T  # [in, out]
    np.testing.assert_array_equal(_bits(layer.weight), bfloat16_bits(full))
    layer.quant_method.process_weights_after_loading(layer)
    packed = ops_class is CpuOps and ops._ready()
    assert layer.weight.ndim == (4 if packed else 2)
    np.testing.assert_array_equal(_bits(ops.unprepare_linear_weight(layer.weight)), bfloat16_bits(full))
    x = paddle.to_tensor(rng.standard_normal((5, 64)).astype(np.float32))
    want = bf16_linear_reference(x, paddle.to_tensor(bfloat16_bits(full)), layer.bias).numpy()
    np.testing.assert_allclose(layer(x).numpy(), want, rtol=1e-5, atol=1e-5)
    # bfloat16 keeps ~3 significant digits: the layer is near the float32 product, not equal to it
    exact = x.numpy() @ full + 0.5
    error = np.abs(layer(x).numpy() - exact).max() / np.abs(exact).max()
    assert 1e-4 < error < BFloat16Linear.expected_error


def test_the_lm_head_is_bfloat16_too(restore_ops):
    set_current_ops(CpuOps())
    head = LMHead(256, 64, quant_config=BFloat16Linear())
    assert isinstance(head.quant_method, BFloat16Linear) and head.weight.dtype == paddle.bfloat16
    table = np.random.default_rng(1).standard_normal((256, 64)).astype(np.float32)  # a tied head's [V, H]
    head.weight.weight_loader(head.weight, table)
    head.quant_method.process_weights_after_loading(head)
    hidden = paddle.to_tensor(np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32))
    logits = head(hidden).numpy()
    want = bf16_linear_reference(hidden, paddle.to_tensor(bfloat16_bits(table.T))).numpy()
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    assert head.greedy_tokens(hidden).tolist() == np.argmax(logits, axis=1).tolist()


def test_mixture_of_experts_is_refused_naming_the_dtype():
    with pytest.raises(ConfigError, match="dtype: bfloat16 covers dense linear layers only") as info:
        FusedMoE(4, 64, 32, quant_config=BFloat16Linear(), prefix="model.layers.0.mlp.experts")
    assert info.value.param == "dtype"


def test_it_is_not_a_registered_quantization_method():
    from fastdeploy_core.errors import QuantizationError
    from fastdeploy_core.quantization.registry import resolve_quantization

    with pytest.raises(QuantizationError, match="unknown quantization method 'bfloat16'"):
        resolve_quantization("bfloat16")
