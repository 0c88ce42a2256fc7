"""``--dtype bfloat16``: linear layers (and the LM head) with bfloat16 weights.

Not a quantization method a user names: the model runner builds it when the model's dtype is
``bfloat16`` (and refuses it together with ``--quantization``, which stores the same layers in
another format). It reuses the quantizer machinery for loading, so checkpoint shards (merged
Q/K/V, gate/up), tied heads and GGUF tensors fill it like any weight-only method:

* storage: ``weight bfloat16 [in, out]``, each float32 checkpoint value rounded to the nearest
  bfloat16 (ties to even); a bfloat16 checkpoint's values arrive unchanged;
* compute: the device op ``ops.bf16_linear(x, weight, bias)``, whose reference formula
  (:meth:`~fastdeploy_core.devices.reference_ops.ReferenceOps.bf16_linear`) rounds ``x`` to
  bfloat16 the same way and sums the exact products in float32; the output is float32. A merged
  gate/up projection asks for ``ops.bf16_linear_silu_and_mul`` (the SwiGLU of the product's
  halves in one op) where the device has it, and a head's greedy tokens
  ``ops.bf16_linear_argmax`` (no logits). ``x`` may also arrive as bfloat16 rows already rounded
  the same way (:attr:`BFloat16Linear.takes_bf16_rows`): the cpu table's fused SwiGLU returns its
  rows so, and the decoder's norms write them so before the QKV and gate/up projections
  (``ops.rms_norm_bf16_rows``); the products are the same.

Everything else the model computes stays float32: the token embedding, norms (their arithmetic;
only the rows they hand a bfloat16 linear are rounded), rotary, attention, softmax, the KV cache,
MoE experts (refused for now) and the sampler.
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy_core.devices.current import current_ops
from fastdeploy_core.devices.reference_ops import bf16_linear_reference
from fastdeploy_core.errors import ConfigError
from fastdeploy_core.quantization.base import QuantizerBase, QuantizerConfig
from fastdeploy_core.quantization.codes import bfloat16_bits


class BFloat16Linear(QuantizerBase):
    """Linear layers and the LM head stored in bfloat16, run by ``ops.bf16_linear``."""

    name = "bfloat16"
    config_class = QuantizerConfig
    device_op = "bf16_linear"
    fused_silu_op = "bf16_linear_silu_and_mul"
    fused_argmax_op = "bf16_linear_argmax"
    requires_device_support = False  # the dtype check (config.check_dtype) is what asks the device
    #: ``ops.bf16_linear`` reads bfloat16 rows as it reads float32 ones it rounds: a norm before
    #: the layer may round its output itself (``ops.rms_norm_bf16_rows``).
    takes_bf16_rows = True
    #: bfloat16 keeps 8 significant bits: Gaussian layers land ~3e-3 (relative) from float32.
    expected_error = 0.01

    def storage_shapes(self, input_size: int, output_size: int):
        return {"weight": ([input_size, output_size], "bfloat16")}

    def quantize(self, weight: np.ndarray) -> dict[str, np.ndarray]:
        return {"weight": bfloat16_bits(weight)}

    def lm_head_method(self) -> QuantizerBase:
        """The head is a linear layer too: bfloat16 (a tied head gets its own bfloat16 copy of
        the embedding, which stays float32 for the lookups)."""
        return self

    def get_embedding_method(self, layer, prefix: str):
        return None  # lookups stay float32

    def get_moe_method(self, layer, prefix: str):
        raise ConfigError(
            f"dtype: bfloat16 covers dense linear layers only; this model has mixture-of-experts layers "
            f"({prefix}), whose experts would stay float32 unannounced; use --dtype float32 (or auto)",
            param="dtype",
        )

    def dequantize(self, layer) -> paddle.Tensor:
        return current_ops().unprepare_linear_weight(layer.weight).astype("float32")

    def op_args(self, layer) -> tuple:
        return (layer.weight,)

    @staticmethod
    def reference_op(x, weight, bias=None):
        return bf16_linear_reference(x, weight, bias)
