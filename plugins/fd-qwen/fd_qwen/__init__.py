"""fastdeploy-core plugin fd-qwen: native Qwen-family models (Qwen2, Qwen3, Qwen3-MoE)."""

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION

#: Architecture -> class; a class is imported only when a model of it loads.
ARCHITECTURES = {
    "Qwen2ForCausalLM": "fd_qwen.qwen:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "fd_qwen.qwen:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "fd_qwen.qwen:Qwen3MoeForCausalLM",
}


@hookimpl
def register_models(register):
    for architecture, target in ARCHITECTURES.items():
        register(architecture, target, impl="fastdeploy")
