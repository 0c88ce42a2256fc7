"""GGUF conversion round trip (llama.cpp's q/k permutation, quantized tensors, llama3 rope_freqs)
and the typed errors for bad model inputs."""

import json
import os
import shutil

os.environ.setdefault("OMP_NUM_THREADS", "2")

import gguf
import numpy as np
import pytest
import torch
from fd_llama.llama import LlamaForCausalLM
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from fastdeploy_core.default_model import default_model_path
from fastdeploy_core.errors import ModelLoadError, UnsupportedArchitectureError
from fastdeploy_core.loader import iterate_gguf, iterate_safetensors, load_model_weights, resolve_model_source
from fastdeploy_core.testing.paged_harness import PagedHarness

TINY = dict(
    vocab_size=61,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    initializer_range=0.25,
    tie_word_embeddings=False,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to attn_q / attn_k rows (interleaved RoPE order)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path, hf_model, qtype=gguf.GGMLQuantizationType.F32, arch="llama", rope_freqs=None):
    """A GGUF of ``hf_model`` written the way llama.cpp's converter lays it out."""
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    parts = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for name, tensor in hf_model.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        if name in names:
            gguf_name = names[name]
        else:
            layer, rest = name[len("model.layers.") :].split(".", 1)
            part, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{parts[part]}.{kind}"
        if gguf_name.endswith("attn_q.weight"):
            array = _llama_cpp_permute(array, cfg.num_attention_heads)
        elif gguf_name.endswith("attn_k.weight"):
            array = _llama_cpp_permute(array, cfg.num_key_value_heads)
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny_hf(**overrides):
    torch.manual_seed(99)
    return HFLlama(LlamaConfig(**{**TINY, **overrides})).eval()


def _first_logits(model, prompt):
    return PagedHarness(model, num_blocks=4, block_size=16).step([(prompt, 0, [1, 2])])[0]


def _hf_logits(hf_model, prompt):
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0, -1].numpy()


PROMPT = [1, 9, 33, 4, 58, 20, 7]


def _quant_round_trip(array: np.ndarray, qtype) -> np.ndarray:
    if array.ndim != 2 or qtype == gguf.GGMLQuantizationType.F32:
        return array
    return gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype).astype(np.float32)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType[t] for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")])
def test_gguf_written_like_llama_cpp_loads_to_the_hf_model(tmp_path, qtype):
    hf_model = _tiny_hf()
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, hf_model, qtype)
    source = resolve_model_source(str(tmp_path))  # a directory holding one .gguf
    assert source.format == "gguf" and source.path == str(path)
    assert source.architecture == "LlamaForCausalLM"
    assert source.hf_config["tie_word_embeddings"] is False
    assert (source.hf_config["num_key_value_heads"], source.hf_config["head_dim"]) == (2, 16)
    # What the file holds, in HF row order: quantization acts within rows, so it commutes
    # with llama.cpp's row permutation and the loader must give exactly these values back.
    expected = {k: _quant_round_trip(v.numpy(), qtype) for k, v in hf_model.state_dict().items()}
    weights = dict(iterate_gguf(source.path))
    assert set(weights) == set(expected)
    for name, array in weights.items():
        np.testing.assert_array_equal(array, expected[name], err_msg=name)
    hf_model.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()})
    model = LlamaForCausalLM(source.hf_config)
    load_model_weights(model, source)
    ours, ref = _first_logits(model, PROMPT), _hf_logits(hf_model, PROMPT)
    assert np.abs(ours - ref).max() < 1e-4


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path):
    from fastdeploy_core.layers.rotary import compute_inv_freq

    hf_model = _tiny_hf(rope_parameters=dict(LLAMA3))
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    freqs = compute_inv_freq(head_dim, 500000.0, None) / compute_inv_freq(head_dim, 500000.0, LLAMA3)
    write_llama_gguf(tmp_path / "l3.gguf", hf_model, rope_freqs=freqs)
    source = resolve_model_source(str(tmp_path / "l3.gguf"))
    scaling = source.hf_config["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == pytest.approx(8.0)
    assert scaling["original_max_position_embeddings"] == 8192
    model = LlamaForCausalLM(source.hf_config)
    load_model_weights(model, source)
    assert np.abs(_first_logits(model, PROMPT) - _hf_logits(hf_model, PROMPT)).max() < 1e-4


def test_missing_path_says_what_to_pass(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist.*--model"):
        resolve_model_source(str(tmp_path / "nope"))


def test_empty_dir_two_ggufs_and_wrong_file_type(tmp_path):
    with pytest.raises(ModelLoadError, match="neither config.json nor a .gguf"):
        resolve_model_source(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="2 GGUF files"):
        resolve_model_source(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"123")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model_source(str(tmp_path / "weights.bin"))


@pytest.mark.parametrize("keep", [0.01, 0.9])
def test_truncated_gguf_is_a_model_load_error_naming_the_file(tmp_path, keep):
    original = default_model_path()
    broken = tmp_path / "broken.gguf"
    with open(original, "rb") as src, open(broken, "wb") as dst:
        dst.write(src.read(int(os.path.getsize(original) * keep)))
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        source = resolve_model_source(str(broken))
        list(iterate_gguf(source.path))


def test_garbage_gguf_is_a_model_load_error(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match="junk.gguf.*not a readable GGUF"):
        resolve_model_source(str(tmp_path / "junk.gguf"))


def test_unknown_gguf_architecture_is_unsupported(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match="'mamba'.*supported GGUF architectures: llama"):
        resolve_model_source(str(tmp_path / "mamba.gguf"))


@pytest.fixture()
def tiny_hf_dir(tmp_path):
    _tiny_hf().save_pretrained(tmp_path / "hf", safe_serialization=True)
    return tmp_path / "hf"


def test_hf_dir_reports_its_architecture(tiny_hf_dir):
    config = json.loads((tiny_hf_dir / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (tiny_hf_dir / "config.json").write_text(json.dumps(config))
    assert resolve_model_source(str(tiny_hf_dir)).architecture == "FancyNewForCausalLM"
    del config["architectures"]
    (tiny_hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="names no architectures"):
        resolve_model_source(str(tiny_hf_dir))
    (tiny_hf_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model_source(str(tiny_hf_dir))


@pytest.mark.parametrize("damage", ["truncate", "header", "tiny"])
def test_corrupt_safetensors_is_a_model_load_error_naming_the_file(tiny_hf_dir, damage):
    path = tiny_hf_dir / "model.safetensors"
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "header":
        path.write_bytes(data[:8] + b"#" * 20 + data[28:])
    else:
        path.write_bytes(b"\x01\x02")
    source = resolve_model_source(str(tiny_hf_dir))
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model_weights(LlamaForCausalLM(source.hf_config), source)


def test_bf16_safetensors_load_as_float32(tmp_path):
    hf_model = _tiny_hf()
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    weights = dict(iterate_safetensors(str(tmp_path)))
    for name, tensor in hf_model.state_dict().items():
        assert weights[name].dtype == np.float32
        np.testing.assert_array_equal(weights[name], tensor.float().numpy())


def test_checkpoint_of_another_shape_or_model_is_rejected(tiny_hf_dir, tmp_path):
    source = resolve_model_source(str(tiny_hf_dir))
    wrong = dict(source.hf_config, intermediate_size=128)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.\w+_proj.*shape"):
        load_model_weights(LlamaForCausalLM(wrong), source)
    model = LlamaForCausalLM(source.hf_config)
    with pytest.raises(ModelLoadError, match="no place for.*vision_tower"):
        model.load_weights([("vision_tower.patch.weight", np.zeros(3, np.float32))])
    with pytest.raises(ModelLoadError, match="lacks"):
        model.load_weights([("model.norm.weight", np.ones(64, np.float32))])
    shutil.rmtree(tiny_hf_dir)


def test_gguf_tensors_can_be_handed_over_as_raw_blocks(tmp_path):
    """A quantizer's block filter gets Q8_0 linear weights as raw blocks, Q/K rows un-permuted."""
    hf_model = _tiny_hf()
    write_llama_gguf(tmp_path / "q8.gguf", hf_model, gguf.GGMLQuantizationType.Q8_0)
    path = str(tmp_path / "q8.gguf")
    floats = dict(iterate_gguf(path))
    asked = []

    def keep(name, type_name):
        asked.append((name, type_name))
        return name.endswith("proj.weight") and type_name == "Q8_0"

    raw = dict(iterate_gguf(path, keep_blocks=keep))
    assert ("model.layers.0.self_attn.q_proj.weight", "Q8_0") in asked
    assert ("model.norm.weight", "F32") not in asked  # 1-D tensors are never blocks
    for name, value in raw.items():
        if name.endswith("proj.weight"):
            assert type(value).__name__ == "GGUFBlocks" and value.shape == floats[name].shape
            np.testing.assert_array_equal(value.dequantize(), floats[name], err_msg=name)
        else:
            np.testing.assert_array_equal(value, floats[name], err_msg=name)


def test_hf_dir_without_safetensors_says_what_is_supported(tiny_hf_dir):
    (tiny_hf_dir / "model.safetensors").rename(tiny_hf_dir / "pytorch_model.bin")
    source = resolve_model_source(str(tiny_hf_dir))
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors files.*\.bin checkpoints are not supported"):
        load_model_weights(LlamaForCausalLM(source.hf_config), source)
