"""An example third-party device plugin: the whole contract a chip vendor fills, in one package.

Paddle's CPU place stands in for the chip so it runs anywhere; a real plugin changes
``paddle_device_type``, ``detect`` and ``memory_info`` (see docs/writing-a-plugin.md).
"""

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION


@hookimpl
def register_devices(register):
    from fd_example_chip.device import ExampleChip

    register(ExampleChip)
