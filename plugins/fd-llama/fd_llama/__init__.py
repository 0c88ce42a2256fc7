"""fastdeploy-core plugin fd-llama: native Llama-family models (Llama 2/3/3.1, SmolLM, Mistral-style)."""

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION

#: Architectures this plugin serves natively; the class is imported only when a model loads.
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


@hookimpl
def register_models(register):
    for architecture in ARCHITECTURES:
        register(architecture, "fd_llama.llama:LlamaForCausalLM", impl="fastdeploy")
