"""fastdeploy-core: a small LLM inference core on PaddlePaddle with a plugin contract.

Public offline API: ``from fastdeploy_core import LLM, SamplingParams``.
"""

from __future__ import annotations

import os
import warnings

# Paddle sets OMP_NUM_THREADS=1 on import when it is unset, which makes every GEMM single-core.
# Plugins may import Paddle while they load, so the default is set here, before any of that.
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))

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
