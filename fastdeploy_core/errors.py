"""Typed errors of fastdeploy-core.

Every error carries the fix in its message and maps to exactly one HTTP status, so the
server never has to guess (bad input is a 4xx, never a 500).
"""

from __future__ import annotations


class FastDeployError(Exception):
    """Base of every error the project raises on purpose."""

    http_status: int = 500
    error_type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class ConfigError(FastDeployError, ValueError):
    """A configuration value is missing, out of range or inconsistent."""

    http_status = 400
    error_type = "invalid_request_error"


class InvalidRequestError(FastDeployError, ValueError):
    """A request (prompt or sampling parameters) cannot be served as given."""

    http_status = 400
    error_type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """The prompt (plus requested tokens) does not fit into max_model_len."""

    code = "context_length_exceeded"


class PluginError(FastDeployError):
    """A plugin is broken, incompatible or clashes with another one."""

    error_type = "plugin_error"


class DuplicateRegistrationError(PluginError):
    """Two plugins registered the same name under one hook."""


class PluginAPIVersionError(PluginError):
    """A plugin was written against another version of the plugin contract."""


class DeviceUnavailableError(FastDeployError):
    """The requested device is not provided by any plugin, or is not usable on this machine."""

    error_type = "device_unavailable"


class ModelLoadError(FastDeployError, ValueError):
    """The model path is missing, unreadable, corrupt, or of an unsupported architecture."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "model_load_error"


class UnsupportedArchitectureError(ModelLoadError):
    """No installed plugin provides the checkpoint's architecture."""


class OutOfKVCacheError(ConfigError):
    """The KV cache cannot hold even one max_model_len sequence."""


class EngineDeadError(FastDeployError):
    """The engine core stopped; the request cannot be served until it is restarted."""

    http_status = 503
    error_type = "service_unavailable"
    code = "engine_dead"


class QuantizationError(ConfigError):
    """A quantization method is unknown, malformed, or not supported on the chosen device."""


class KVTransferError(FastDeployError):
    """A prefill/decode pair could not move a request's KV cache (peer gone, no room, mismatch)."""

    http_status = 503
    error_type = "service_unavailable"
    code = "kv_transfer_failed"


class PairingRefusedError(FastDeployError):
    """A decode instance got a router pairing header whose signature does not verify."""

    http_status = 403
    error_type = "authentication_error"
