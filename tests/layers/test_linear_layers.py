"""Linear layers: HF [out, in] shards load into fused [in, out] weights; quant methods plug in."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.layers.linear import Linear, LinearMethodBase, MergedColumnLinear, QKVLinear


def test_qkv_shards_load_into_one_matmul():
    rng = np.random.default_rng(0)
    layer = QKVLinear(hidden_size=8, head_dim=2, num_heads=4, num_kv_heads=2, bias=True)
    shards = {"q": rng.standard_normal((8, 8)), "k": rng.standard_normal((4, 8)), "v": rng.standard_normal((4, 8))}
    biases = {name: rng.standard_normal(w.shape[0]) for name, w in shards.items()}
    for name in ("v", "q", "k"):  # any order
        layer.weight.weight_loader(layer.weight, shards[name], name)
        layer.bias.weight_loader(layer.bias, biases[name], name)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    expected = np.concatenate([x @ shards[n].T + biases[n] for n in ("q", "k", "v")], axis=1)
    np.testing.assert_allclose(layer(paddle.to_tensor(x)).numpy(), expected, atol=1e-5)
    with pytest.raises(ModelLoadError, match="shard 'k'"):
        layer.weight.weight_loader(layer.weight, shards["q"], "k")


def test_merged_gate_up_by_index_and_plain_linear_shape_check():
    layer = MergedColumnLinear(4, [3, 3])
    layer.weight.weight_loader(layer.weight, np.ones((3, 4)), 1)
    assert layer.weight.numpy()[:, :3].sum() == 0 and layer.weight.numpy()[:, 3:].sum() == 12
    plain = Linear(4, 2, prefix="model.layers.0.mlp.down_proj")
    with pytest.raises(ModelLoadError, match="down_proj"):
        plain.weight.weight_loader(plain.weight, np.ones((4, 2)))


class DoublingMethod(LinearMethodBase):
    """A toy quantization method: stores W and computes 2 * x @ W, to see the plug point work."""

    def __init__(self):
        self.processed = []

    def create_weights(self, layer):
        layer.weight = layer.create_parameter([layer.input_size, layer.output_size], dtype="float32")
        layer.weight.stop_gradient = True
        layer.weight.weight_loader = layer.weight_loader
        layer.bias = None

    def process_weights_after_loading(self, layer):
        self.processed.append(layer.prefix)

    def apply(self, layer, x):
        return paddle.matmul(x, layer.weight) * 2


class DoublingConfig:
    def __init__(self):
        self.method = DoublingMethod()

    def get_quant_method(self, layer, prefix):
        return None if prefix.endswith(("o_proj", "lm_head")) else self.method


def test_quant_config_chooses_the_method_per_layer_and_model_finishes_loading():
    from fd_llama.llama import LlamaForCausalLM

    config = dict(
        hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=11, tie_word_embeddings=True,
    )  # fmt: skip
    quant = DoublingConfig()
    model = LlamaForCausalLM(config, quant_config=quant)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_proj.quant_method is quant.method and mlp.down_proj.quant_method is quant.method
    assert type(attn.o_proj.quant_method).__name__ == "UnquantizedLinearMethod"
    rng = np.random.default_rng(1)
    weights = [(name, rng.standard_normal(tuple(reversed(p.shape)) if p.ndim == 2 else tuple(p.shape)).astype(np.float32))
               for name, p in model.named_parameters() if not name.startswith("lm_head")]  # fmt: skip
    hf_names = []
    for name, array in weights:  # split the fused tensors back into HF shards
        if "qkv_proj" in name:
            hf_names += [(name.replace("qkv_proj", "q_proj"), array[:8]), (name.replace("qkv_proj", "k_proj"), array[8:12]),
                         (name.replace("qkv_proj", "v_proj"), array[12:])]  # fmt: skip
        elif "gate_up_proj" in name:
            hf_names += [(name.replace("gate_up_proj", "gate_proj"), array[:16]), (name.replace("gate_up_proj", "up_proj"), array[16:])]
        elif name == "model.embed_tokens.weight":
            hf_names.append((name, array.T))  # embeddings are stored [V, H] like HF
        else:
            hf_names.append((name, array))
    model.load_weights(hf_names)
    assert sorted(quant.method.processed) == ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_up_proj",
                                              "model.layers.0.self_attn.qkv_proj"]  # fmt: skip
    x = paddle.to_tensor(rng.standard_normal((2, 8)).astype(np.float32))
    np.testing.assert_allclose(attn.qkv_proj(x).numpy(), 2 * x.numpy() @ attn.qkv_proj.weight.numpy(), atol=1e-5)
