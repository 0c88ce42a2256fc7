"""fastdeploy-core plugin fd-iluvatar: the ``iluvatar_gpu`` device (Iluvatar CoreX GPUs as a Paddle custom device)."""

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION


@hookimpl
def register_devices(register):
    from fd_iluvatar.device import IluvatarGpu

    register(IluvatarGpu)
