"""Quantization: the quantizer contract, the built-in methods and the cpu kernels.

Methods register by name through the ``register_quantizers`` hook (the core registers its own
in :mod:`fastdeploy_core.builtin.plugin`, lazily, as ``"module:Class"`` targets): ``wint8``,
``wint4``, ``w8a8``, ``w4a8``, ``block_wise_fp8``, ``mix_quant``; the KV cache int8
(``kv_cache_quant_type``) rides on any of them. :func:`resolve_quantization` turns
``--quantization`` into a quantizer object, which a model passes to its layers as
``quant_config``. Importing this package does not import Paddle; the names below load on use.
"""

from __future__ import annotations

import importlib

#: Registry name -> "module:Class" of the core's built-in methods.
BUILTIN_METHODS = {
    "wint8": "fastdeploy_core.quantization.weight_only:WeightOnlyInt8",
    "wint4": "fastdeploy_core.quantization.weight_only:WeightOnlyInt4",
    "w8a8": "fastdeploy_core.quantization.w8a8:W8A8",
    "w4a8": "fastdeploy_core.quantization.w4a8:W4A8",
    "block_wise_fp8": "fastdeploy_core.quantization.fp8:BlockWiseFP8",
    "mix_quant": "fastdeploy_core.quantization.mix_quant:MixQuant",
}

_LAZY = {
    "QuantizerBase": "fastdeploy_core.quantization.base",
    "QuantizerConfig": "fastdeploy_core.quantization.base",
    "parse_spec": "fastdeploy_core.quantization.registry",
    "resolve_quantization": "fastdeploy_core.quantization.registry",
}

__all__ = ["BUILTIN_METHODS", "QuantizerBase", "QuantizerConfig", "parse_spec", "resolve_quantization"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
