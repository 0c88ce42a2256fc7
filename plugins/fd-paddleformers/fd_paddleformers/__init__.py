"""fastdeploy-core plugin fd-paddleformers: the PaddleFormers fallback for model architectures.

Registers nothing yet: the fallback model adapter arrives with its own issue, and until then
`--model-impl paddleformers` reports that the fallback is not available.
"""

from fastdeploy_core import PLUGIN_API_VERSION

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION
