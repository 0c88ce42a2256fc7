"""fastdeploy-core plugin fd-iluvatar (device plugin; its Device declaration arrives with the device-contract work).

Registers nothing yet: it must not pretend to provide a device it does not declare.
"""

from fastdeploy_core import PLUGIN_API_VERSION

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION
