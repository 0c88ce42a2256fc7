"""fastdeploy-core plugin fd-qwen: native Qwen-family models (Qwen2, Qwen3, Qwen3-MoE)."""

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import GGUFArchitecture, hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION

#: Architecture -> class; a class is imported only when a model of it loads.
ARCHITECTURES = {
    "Qwen2ForCausalLM": "fd_qwen.qwen:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "fd_qwen.qwen:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "fd_qwen.qwen:Qwen3MoeForCausalLM",
}


#: llama.cpp's GGUF architecture of each (tensor names and config in :mod:`fd_qwen.gguf`,
#: imported only when such a file is opened)
GGUF_ARCHITECTURES = {
    architecture: GGUFArchitecture(
        name=gguf_name, tensor_names="fd_qwen.gguf:TENSOR_NAMES", hf_config="fd_qwen.gguf:hf_config"
    )
    for architecture, gguf_name in (
        ("Qwen2ForCausalLM", "qwen2"),
        ("Qwen3ForCausalLM", "qwen3"),
        ("Qwen3MoeForCausalLM", "qwen3moe"),
    )
}


@hookimpl
def register_models(register):
    for architecture, target in ARCHITECTURES.items():
        register(architecture, target, impl="fastdeploy", gguf=GGUF_ARCHITECTURES[architecture])
