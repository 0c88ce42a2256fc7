"""GGUF architectures come from model plugins: a plugin's registration is what the loader uses,
and a file of an architecture nobody registered says what is registered and what to install."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import gguf
import numpy as np
import pytest

from fastdeploy_core import PLUGIN_API_VERSION, plugins
from fastdeploy_core.errors import DuplicateRegistrationError, ModelLoadError, PluginError, UnsupportedArchitectureError
from fastdeploy_core.hookspecs import GGUFArchitecture, hookimpl
from fastdeploy_core.loader import GGUFBlocks, iterate_gguf, load_model_weights, resolve_model_source
from fastdeploy_core.loader.gguf_loader import linear_tensor_types

DIMS = {"hidden": 64, "ffn": 96, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 40}

#: the made-up architecture's own tensor names, as its converter would write them
TOY_TENSOR_NAMES = {
    "tok": "model.embed_tokens",
    "final_norm": "model.norm",
    "head": "lm_head",
    "unused_table": None,
    "layer{bid}.norm1": "model.layers.{bid}.input_layernorm",
    "layer{bid}.norm2": "model.layers.{bid}.post_attention_layernorm",
    "layer{bid}.wq": "model.layers.{bid}.self_attn.q_proj",
    "layer{bid}.wk": "model.layers.{bid}.self_attn.k_proj",
    "layer{bid}.wv": "model.layers.{bid}.self_attn.v_proj",
    "layer{bid}.wo": "model.layers.{bid}.self_attn.o_proj",
    "layer{bid}.w1": "model.layers.{bid}.mlp.gate_proj",
    "layer{bid}.w3": "model.layers.{bid}.mlp.up_proj",
    "layer{bid}.w2": "model.layers.{bid}.mlp.down_proj",
}


def toy_hf_config(gguf_file) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": int(gguf_file.get("width")),
        "intermediate_size": int(gguf_file.get("ffn_width")),
        "num_hidden_layers": int(gguf_file.get("depth")),
        "num_attention_heads": int(gguf_file.get("heads")),
        "num_key_value_heads": int(gguf_file.get("kv_heads")),
        "vocab_size": gguf_file.tensor_shape("tok.weight")[0],
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }


def toy_row_order(hf_name: str, rows: int, hf_config: dict):
    """The toy converter stores query rows last-first; take them back."""
    return np.arange(rows)[::-1].copy() if hf_name.endswith("q_proj.weight") else None


TOY_GGUF = GGUFArchitecture(
    name="toyformer", tensor_names=TOY_TENSOR_NAMES, hf_config=toy_hf_config, row_order=toy_row_order
)


class ToyPlugin:
    """A model plugin registering a made-up GGUF architecture, served by fd-llama's class."""

    FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION

    def __init__(self, gguf_arch=TOY_GGUF, architecture="ToyForCausalLM"):
        self.gguf_arch = gguf_arch
        self.architecture = architecture

    @hookimpl
    def register_models(self, register):
        register(self.architecture, "fd_llama.llama:LlamaForCausalLM", gguf=self.gguf_arch)


class OldStylePlugin:
    """A model plugin written before GGUF registration existed: positional register, no gguf."""

    FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION

    @hookimpl
    def register_models(self, register):
        register("OldForCausalLM", "fd_llama.llama:LlamaForCausalLM", "fastdeploy")


def manager_with(*plugin_objects) -> plugins.PluginManager:
    manager = plugins.PluginManager()
    for i, plugin in enumerate(plugin_objects):
        manager.add_plugin(plugin, f"{type(plugin).__name__.lower()}{i}", f"fd-{type(plugin).__name__.lower()}", "0.1")
    manager.run_registration_hooks()
    return manager


def hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-named float32 weights of a tiny Llama of :data:`DIMS`."""
    rng = np.random.default_rng(seed)
    h, f, head_dim = DIMS["hidden"], DIMS["ffn"], DIMS["hidden"] // DIMS["heads"]
    shapes = {
        "model.embed_tokens.weight": (DIMS["vocab"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (DIMS["vocab"], h),
    }
    for i in range(DIMS["layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (DIMS["kv_heads"] * head_dim, h),
            p + "self_attn.v_proj.weight": (DIMS["kv_heads"] * head_dim, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
        })  # fmt: skip
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_toy_gguf(path, weights, arch="toyformer", qtype=gguf.GGMLQuantizationType.F32) -> None:
    """``weights`` under the toy names (query rows reversed), the dims under ``<arch>.*`` keys."""
    to_toy = {}
    for toy, hf in TOY_TENSOR_NAMES.items():
        if hf is None:
            continue
        for i in range(DIMS["layers"]) if "{bid}" in toy else [None]:
            to_toy[hf.format(bid=i) + ".weight"] = toy.format(bid=i) + ".weight"
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (
        ("width", "hidden"),
        ("ffn_width", "ffn"),
        ("depth", "layers"),
        ("heads", "heads"),
        ("kv_heads", "kv_heads"),
    ):
        writer.add_uint32(f"{arch}.{key}", DIMS[value])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, array in weights.items():
        if name.endswith("q_proj.weight"):
            array = np.ascontiguousarray(array[::-1])
        if array.ndim == 2 and ".layers." in name and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(to_toy[name], gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(to_toy[name], array)
    writer.add_tensor("unused_table.weight", np.zeros(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture()
def toy_manager(monkeypatch):
    """The process-wide manager replaced by one holding fd-llama's class under the toy plugin."""
    manager = manager_with(ToyPlugin())
    monkeypatch.setattr(plugins, "_cached", manager)
    return manager


def test_a_plugin_registered_gguf_architecture_loads_through_its_names_config_and_row_order(tmp_path, toy_manager):
    weights = hf_weights()
    write_toy_gguf(tmp_path / "toy.gguf", weights)
    source = resolve_model_source(str(tmp_path / "toy.gguf"))
    assert source.format == "gguf" and source.architecture == "ToyForCausalLM"
    assert source.hf_config == {
        "architectures": ["ToyForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 40,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    loaded = dict(iterate_gguf(source.path, source.hf_config))
    assert sorted(loaded) == sorted(weights)  # "unused_table" skipped, every name mapped
    for name, array in weights.items():
        np.testing.assert_array_equal(loaded[name], array, err_msg=name)  # q rows back in order
    model_cls = toy_manager.resolve_model(source.architecture)
    model = model_cls(source.hf_config)
    load_model_weights(model, source)  # every tensor finds its parameter


def test_row_order_applies_to_raw_blocks_and_linear_types_come_from_the_tensor_map(tmp_path, toy_manager):
    path = str(tmp_path / "toy_q8.gguf")
    write_toy_gguf(path, hf_weights(seed=1), qtype=gguf.GGMLQuantizationType.Q8_0)
    assert linear_tensor_types(path) == {"Q8_0"}  # per-layer 2-D weights only (tok/head are F32)
    floats = dict(iterate_gguf(path))
    raw = dict(iterate_gguf(path, keep_blocks=lambda name, type_name: type_name == "Q8_0"))
    q_name = "model.layers.0.self_attn.q_proj.weight"
    assert isinstance(raw[q_name], GGUFBlocks)
    for name, value in raw.items():
        got = value.dequantize() if isinstance(value, GGUFBlocks) else value
        np.testing.assert_array_equal(got, floats[name], err_msg=name)


def test_unregistered_gguf_architecture_lists_the_registered_ones_and_what_to_install(tmp_path, toy_manager):
    write_toy_gguf(tmp_path / "other.gguf", hf_weights(), arch="otherformer")
    with pytest.raises(ModelLoadError) as info:
        resolve_model_source(str(tmp_path / "other.gguf"))
    assert isinstance(info.value, UnsupportedArchitectureError)
    message = str(info.value)
    assert "GGUF architecture 'otherformer' of " in message
    assert "supported GGUF architectures: toyformer (fd-toyplugin);" in message
    assert "install a model plugin that registers this GGUF architecture" in message
    # a known architecture whose plugin is missing names that plugin
    write_toy_gguf(tmp_path / "llama.gguf", hf_weights(), arch="llama")
    with pytest.raises(
        UnsupportedArchitectureError, match="'llama'.*toyformer \\(fd-toyplugin\\); install the model plugin `fd-llama`"
    ):
        resolve_model_source(str(tmp_path / "llama.gguf"))


def test_gguf_registration_is_listed_checked_and_keeps_old_plugins_working():
    manager = manager_with(ToyPlugin(), OldStylePlugin())
    rows = {row["name"]: row for row in manager.describe()}
    assert rows["toyplugin0"]["gguf_architectures"] == ["toyformer -> ToyForCausalLM"]
    assert rows["toyplugin0"]["registered"]["models"] == ["ToyForCausalLM (fastdeploy)"]
    assert rows["oldstyleplugin1"]["gguf_architectures"] == []
    assert manager.model_provider("OldForCausalLM")[1] == "fastdeploy"
    with pytest.raises(DuplicateRegistrationError, match="GGUF architecture 'toyformer' is registered twice"):
        manager_with(ToyPlugin(), ToyPlugin(architecture="Toy2ForCausalLM"))
    with pytest.raises(PluginError, match="gguf= takes a fastdeploy_core.hookspecs.GGUFArchitecture, got dict"):
        manager_with(ToyPlugin(gguf_arch={"name": "toyformer"}))
    with pytest.raises(PluginError, match="needs the HF architecture it loads as, not '\\*'"):
        manager_with(ToyPlugin(architecture="*"))


def test_the_llama_plugin_registers_llama_gguf():
    manager = plugins.load_plugins()
    assert manager.gguf_architectures.entry("llama").plugin == "llama"
    assert manager.gguf_architectures.get("llama")[0] == "LlamaForCausalLM"
    rows = {row["name"]: row for row in manager.describe()}
    assert rows["llama"]["gguf_architectures"] == ["llama -> LlamaForCausalLM"]
