"""fastdeploy-core plugin fd-nvidia: the ``gpu`` device (NVIDIA GPUs through Paddle's CUDA build)."""

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION


@hookimpl
def register_devices(register):
    from fd_nvidia.device import NvidiaGpu

    register(NvidiaGpu)
