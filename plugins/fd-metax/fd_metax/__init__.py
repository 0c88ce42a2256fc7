"""fastdeploy-core plugin fd-metax: the ``metax_gpu`` device (MetaX GPUs (C550) as a Paddle custom device)."""

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION


@hookimpl
def register_devices(register):
    from fd_metax.device import MetaxGpu

    register(MetaxGpu)
