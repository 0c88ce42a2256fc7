"""fastdeploy-core plugin fd-paddleformers: the PaddleFormers fallback for model architectures.

Registers one model provider for every architecture (``"*"``) with ``impl="paddleformers"``:
:class:`fd_paddleformers.model.PaddleFormersForCausalLM` builds the checkpoint's model with
PaddleFormers and serves it through the core's paged attention, linears and norms. It is
imported only when a model loads (PaddleFormers takes seconds to import), and
``PaddleFormersForCausalLM.supports(hf_config)`` says whether a checkpoint can be served.
"""

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION

MODEL_TARGET = "fd_paddleformers.model:PaddleFormersForCausalLM"


@hookimpl
def register_models(register):
    register("*", MODEL_TARGET, impl="paddleformers")
