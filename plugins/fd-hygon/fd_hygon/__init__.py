"""fastdeploy-core plugin fd-hygon: the ``dcu`` device (Hygon DCUs through Paddle's ROCm build)."""

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION


@hookimpl
def register_devices(register):
    from fd_hygon.device import HygonDcu

    register(HygonDcu)
