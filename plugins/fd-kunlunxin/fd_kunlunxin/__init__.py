"""fastdeploy-core plugin fd-kunlunxin: the ``xpu`` device (Kunlunxin XPUs through Paddle's XPU build)."""

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION


@hookimpl
def register_devices(register):
    from fd_kunlunxin.device import KunlunxinXpu

    register(KunlunxinXpu)
