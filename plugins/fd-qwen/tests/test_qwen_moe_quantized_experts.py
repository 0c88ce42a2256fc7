"""Quantized MoE experts: ``wint8``/``wint4`` store a Qwen3-MoE's experts as integer codes, the
router stays float32, and the perplexity of a fixed token sequence stays near float32's.

The sequence is a prompt plus transformers' 57 greedy tokens of the same random checkpoint
(float32 perplexity ~6.2, so quantization error shows). Measured on this config (reference ops):
experts-only wint8 +0.11 %, whole-model wint8 +0.83 %, experts-only wint4 (groups of 128 rows)
+9.2 %. The tolerances below are about three times those: 0.5 %, 3 % and 25 %.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import paddle
import pytest
import torch
import transformers
from fd_qwen.qwen import Qwen3MoeForCausalLM

from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.errors import QuantizationError
from fastdeploy_core.layers.linear import UnquantizedLinearMethod
from fastdeploy_core.testing.perplexity import greedy_sequence, load_model, sequence_perplexity

pytestmark = pytest.mark.usefixtures("restore_ops")

CONFIG = {
    "vocab_size": 97,
    "hidden_size": 128,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(7)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG)).eval()
    path = str(tmp_path_factory.mktemp("qwen3_moe_quant"))
    hf.save_pretrained(path, safe_serialization=True)
    sequence = greedy_sequence(hf, [1, 5, 17, 33, 8, 60, 42], 57)
    return path, sequence


def _load(path: str, quant: str | None, settings: dict | None = None):
    set_current_ops(ReferenceOps())
    return load_model(Qwen3MoeForCausalLM, path, quant, settings)


@pytest.mark.parametrize(
    ("quant", "settings", "codes_dtype", "tolerance"),
    [
        ("mix_quant", {"moe_quant_type": "wint8"}, paddle.int8, 0.005),
        ("wint8", {}, paddle.int8, 0.03),
        ("mix_quant", {"moe_quant_type": "wint4"}, paddle.uint8, 0.25),
    ],
    ids=["wint8_experts", "wint8_everything", "wint4_experts"],
)
def test_quantized_experts_perplexity_near_float(checkpoint, quant, settings, codes_dtype, tolerance):
    path, sequence = checkpoint
    reference = sequence_perplexity(_load(path, None), sequence)
    model = _load(path, quant, settings)
    for layer in model.model.layers:
        experts, gate = layer.mlp.experts, layer.mlp.gate
        assert experts.w13_weight.dtype == codes_dtype and experts.w2_weight.dtype == codes_dtype
        assert gate.weight.dtype == paddle.float32 and isinstance(
            gate.quant_method, UnquantizedLinearMethod
        )  # the router stays float32
    quantized = sequence_perplexity(model, sequence)
    assert quantized != reference  # the experts really run from their codes
    assert abs(quantized / reference - 1) <= tolerance, (reference, quantized)


def test_quantized_experts_fail_when_codes_are_wrong(checkpoint):
    """The tolerance can fail: experts whose codes lost their sign give a far worse perplexity."""
    path, sequence = checkpoint
    reference = sequence_perplexity(_load(path, None), sequence)
    model = _load(path, "mix_quant", {"moe_quant_type": "wint8"})
    for layer in model.model.layers:
        layer.mlp.experts.w2_weight.set_value(-layer.mlp.experts.w2_weight)
    assert abs(sequence_perplexity(model, sequence) / reference - 1) > 0.005


def test_a_method_that_cannot_store_experts_refuses_the_model(checkpoint):
    path, _ = checkpoint
    with pytest.raises(QuantizationError, match=r"'w8a8' cannot store mixture-of-experts weights .*experts.*wint8"):
        _load(path, "w8a8")
    # unless the experts are kept float32 by name
    model = _load(path, "w8a8", {"modules_to_not_convert": ["*.experts"]})
    assert model.model.layers[0].mlp.experts.w13_weight.dtype == paddle.float32
