"""Quantized MoE experts on ERNIE-4.5-MoE (shared experts, router correction bias): ``wint8``/
``wint4`` store the routed experts as integer codes, the router and its correction bias stay
float32, the shared experts and the dense layers follow the dense method (float32 when only the
experts are quantized), and the perplexity of a fixed token sequence stays near float32's.

The checkpoint is a tiny random transformers ERNIE-4.5-MoE: layer 0 a dense MLP, layers 1-2
mixtures of 8 experts (top 2) plus one shared expert, random correction biases, tied
embeddings. The sequence is a prompt plus transformers' 57 greedy tokens of it (float32
perplexity ~5.87, so quantization error shows). Measured on this config (reference ops):
experts-only wint8 +0.049 %, whole-model wint8 (int8 embedding and tied LM head included)
+2.97 %, experts-only wint4 (groups of 128 rows) +1.88 %. The tolerances below are about three
times those: 0.15 %, 9 % and 6 %.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import paddle
import pytest
import torch
import transformers
from fd_ernie.ernie import Ernie4_5_MoeForCausalLM

from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.errors import QuantizationError
from fastdeploy_core.layers.linear import UnquantizedLinearMethod
from fastdeploy_core.layers.moe import SparseMoeBlock
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
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "moe_num_experts": 8,
    "moe_k": 2,
    "moe_intermediate_size": 64,
    "moe_num_shared_experts": 1,
    "moe_layer_start_index": 1,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(7)
    hf = transformers.Ernie4_5_MoeForCausalLM(transformers.Ernie4_5_MoeConfig(**CONFIG)).eval()
    with torch.no_grad():  # random correction biases, so that they change some expert choices
        for module in hf.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.05)
    path = str(tmp_path_factory.mktemp("ernie_moe_quant"))
    hf.save_pretrained(path, safe_serialization=True)
    return path, greedy_sequence(hf, [1, 5, 17, 33, 8, 60, 42], 57)


def _load(path: str, quant: str | None, settings: dict | None = None):
    set_current_ops(ReferenceOps())
    return load_model(Ernie4_5_MoeForCausalLM, path, quant, settings)


def _moe_blocks(model) -> list[SparseMoeBlock]:
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert len(blocks) == 2 and all(block.shared_experts is not None for block in blocks)
    return blocks


@pytest.mark.parametrize(
    ("quant", "settings", "codes_dtype", "dense_dtype", "tolerance"),
    [
        ("mix_quant", {"moe_quant_type": "wint8"}, paddle.int8, paddle.float32, 0.0015),
        ("wint8", {}, paddle.int8, paddle.int8, 0.09),
        ("mix_quant", {"moe_quant_type": "wint4"}, paddle.uint8, paddle.float32, 0.06),
    ],
    ids=["wint8_experts", "wint8_everything", "wint4_experts"],
)
def test_quantized_experts_perplexity_near_float(checkpoint, quant, settings, codes_dtype, dense_dtype, tolerance):
    path, sequence = checkpoint
    reference = sequence_perplexity(_load(path, None), sequence)
    model = _load(path, quant, settings)
    for block in _moe_blocks(model):
        experts, gate = block.experts, block.gate
        assert experts.w13_weight.dtype == codes_dtype and experts.w2_weight.dtype == codes_dtype
        assert gate.weight.dtype == paddle.float32 and isinstance(
            gate.quant_method, UnquantizedLinearMethod
        )  # the router stays float32
        assert block.e_score_correction_bias.dtype == paddle.float32
        shared = block.shared_experts  # a dense gated MLP: the dense method's, not the experts'
        assert shared.gate_up_proj.weight.dtype == dense_dtype and shared.down_proj.weight.dtype == dense_dtype
    dense_mlp = model.model.layers[0].mlp
    assert not isinstance(dense_mlp, SparseMoeBlock) and dense_mlp.gate_up_proj.weight.dtype == dense_dtype
    quantized = sequence_perplexity(model, sequence)
    assert quantized != reference  # the experts really run from their codes
    assert abs(quantized / reference - 1) <= tolerance, (reference, quantized)


def test_quantized_experts_fail_when_codes_are_wrong(checkpoint):
    """The tolerance can fail: experts whose codes lost their sign give a far worse perplexity."""
    path, sequence = checkpoint
    reference = sequence_perplexity(_load(path, None), sequence)
    model = _load(path, "mix_quant", {"moe_quant_type": "wint8"})
    for block in _moe_blocks(model):
        block.experts.w2_weight.set_value(-block.experts.w2_weight)
    assert abs(sequence_perplexity(model, sequence) / reference - 1) > 0.0015


def test_a_method_that_cannot_store_experts_refuses_the_model(checkpoint):
    path, _ = checkpoint
    with pytest.raises(QuantizationError, match=r"'w8a8' cannot store mixture-of-experts weights .*experts.*wint8"):
        _load(path, "w8a8")
    # unless the experts are kept float32 by name
    model = _load(path, "w8a8", {"modules_to_not_convert": ["*.experts"]})
    assert all(block.experts.w13_weight.dtype == paddle.float32 for block in _moe_blocks(model))
