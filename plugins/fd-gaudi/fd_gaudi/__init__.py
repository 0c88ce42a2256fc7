"""fastdeploy-core plugin fd-gaudi: the ``intel_hpu`` device (Intel Gaudi HPUs as a Paddle custom device)."""

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION


@hookimpl
def register_devices(register):
    from fd_gaudi.device import IntelHpu

    register(IntelHpu)
