"""fastdeploy-core plugin fd-ernie: native ERNIE-4.5 models (dense and mixture of experts)."""

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION

#: Architecture -> class; a class is imported only when a model of it loads.
ARCHITECTURES = {
    "Ernie4_5ForCausalLM": "fd_ernie.ernie:Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM": "fd_ernie.ernie:Ernie4_5_MoeForCausalLM",
}


@hookimpl
def register_models(register):
    for architecture, target in ARCHITECTURES.items():
        register(architecture, target, impl="fastdeploy")
