"""fastdeploy-core plugin fd-enflame: the ``gcu`` device (Enflame GCUs (S60) as a Paddle custom device)."""

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION


@hookimpl
def register_devices(register):
    from fd_enflame.device import EnflameGcu

    register(EnflameGcu)
