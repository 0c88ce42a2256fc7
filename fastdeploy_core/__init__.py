"""fastdeploy-core: a small LLM inference core on PaddlePaddle with a plugin contract.

Public offline API: ``from fastdeploy_core import LLM, SamplingParams``.
"""

from __future__ import annotations

import warnings

from fastdeploy_core.builtin.cpu.process_env import configure_process_env

# Plugins may import Paddle while they load, and Paddle reads its thread settings then: the
# cpu device's process settings go into the environment first, here, once.
configure_process_env()

# Paddle warns on import that ccache is missing (it only speeds up rebuilding C++ extensions);
# it is noise on every CLI call.
warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)

__version__ = "0.1.0"

#: Version of the plugin contract (hookspecs + registries + Device/ops shape).
#: A plugin declares ``FD_PLUGIN_API_VERSION`` in its hook module; a different major is refused.
PLUGIN_API_VERSION = 1

__all__ = ["LLM", "SamplingParams", "PLUGIN_API_VERSION", "__version__"]


def __getattr__(name: str):
    # Lazy so that `fastdeploy plugins` and the plugin machinery never import Paddle.
    if name == "LLM":
        from fastdeploy_core.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fastdeploy_core.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
