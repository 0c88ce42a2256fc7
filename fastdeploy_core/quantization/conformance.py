"""Load-and-run check of a quantization method on a device's ops table (used by the conformance kit).

:func:`check_method` builds a merged Q/K/V layer quantized with the method, loads float
checkpoint shards into it (online quantization, shard by shard), and checks that

1. the device's op for the method (when its ops table has one) computes the method's
   reference formula: ``max|y_op - y_ref| <= 1e-4 * max|y_ref|``;
2. the quantized layer stays within the method's ``expected_error`` of the float32 layer.
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy_core.devices.current import current_ops, set_current_ops
from fastdeploy_core.quantization.factory import build_quantizer

OP_RTOL = 1e-4


def _relative(a: paddle.Tensor, b: paddle.Tensor) -> float:
    return float(paddle.abs(a - b).max()) / max(float(paddle.abs(b).max()), 1e-12)


def check_method(ops, method: str, plugin_manager=None, seed: int = 0) -> dict:
    """Raise AssertionError when ``method`` misbehaves on ``ops``; returns the measured errors."""
    from fastdeploy_core.layers.linear import QKVLinear

    settings = {"dense_quant_type": "wint8"} if method == "mix_quant" else {}
    quantizer = build_quantizer(method, settings, plugin_manager)
    rng = np.random.default_rng(seed)
    hidden, head_dim, heads, kv_heads = 256, 32, 8, 2
    layer = QKVLinear(hidden, head_dim, heads, kv_heads, bias=True, quant_config=quantizer, prefix="check.qkv_proj")
    floats = QKVLinear(hidden, head_dim, heads, kv_heads, bias=True, prefix="check.qkv_proj")
    method_obj = layer.quant_method
    if method_obj is None or not hasattr(method_obj, "op_args"):
        raise AssertionError(f"{method}: get_quant_method returned {method_obj!r} for a dense linear layer")
    for shard, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
        weight = (rng.standard_normal((rows, hidden)) / np.sqrt(hidden)).astype(np.float32)
        bias = rng.standard_normal(rows).astype(np.float32) * 0.1
        for target in (layer, floats):
            target.weight.weight_loader(target.weight, weight, shard)
            target.bias.weight_loader(target.bias, bias, shard)
    x = paddle.to_tensor(rng.standard_normal((5, hidden)).astype(np.float32))
    previous = current_ops()
    set_current_ops(ops)
    try:
        method_obj.process_weights_after_loading(layer)  # the device's layout, as after a real load
        y = layer(x)
        y_ref = method_obj.reference_op(x, *method_obj.reference_args(layer), layer.bias)
    finally:
        set_current_ops(previous)
    y_float = floats(x)
    op_error = _relative(y, y_ref)
    float_error = _relative(y_ref, y_float)
    has_op = bool(method_obj.device_op) and getattr(ops, method_obj.device_op, None) is not None
    if op_error > OP_RTOL:
        raise AssertionError(
            f"{method}: {type(ops).__name__}.{method_obj.device_op} differs from the reference formula by "
            f"{op_error:.2e} relative (allowed {OP_RTOL})"
        )
    if float_error > method_obj.expected_error:
        raise AssertionError(
            f"{method}: the quantized layer is {float_error:.3f} (relative) away from the float32 layer; "
            f"the method promises at most {method_obj.expected_error}"
        )
    return {"op_error": op_error, "float_error": float_error, "device_op": has_op}
