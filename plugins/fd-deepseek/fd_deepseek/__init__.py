"""fastdeploy-core plugin fd-deepseek: native DeepSeek-V3 (multi-head latent attention, group-limited MoE, MTP weights)."""

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION

#: Architecture -> class; a class is imported only when a model of it loads.
ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "fd_deepseek.deepseek:DeepseekV3ForCausalLM",
}


@hookimpl
def register_models(register):
    for architecture, target in ARCHITECTURES.items():
        register(architecture, target, impl="fastdeploy")
