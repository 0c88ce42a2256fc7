"""fastdeploy-core plugin fd-llama: native Llama-family models (Llama 2/3/3.1, SmolLM, Mistral-style)."""

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import GGUFArchitecture, hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION

#: Architectures this plugin serves natively; the class is imported only when a model loads.
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")

#: llama.cpp's ``llama`` GGUF architecture (its converter writes Mistral-style models as
#: ``llama`` too); the parts are imported only when such a file is opened.
LLAMA_GGUF = GGUFArchitecture(
    name="llama",
    tensor_names="fd_llama.gguf:TENSOR_NAMES",
    hf_config="fd_llama.gguf:hf_config",
    row_order="fd_llama.gguf:row_order",
)


@hookimpl
def register_models(register):
    for architecture in ARCHITECTURES:
        gguf = LLAMA_GGUF if architecture == "LlamaForCausalLM" else None
        register(architecture, "fd_llama.llama:LlamaForCausalLM", impl="fastdeploy", gguf=gguf)
