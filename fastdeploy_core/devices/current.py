"""The ops table of the device the engine runs on.

Layers call ``current_ops().rms_norm(...)`` and never look at a device name. The model
runner installs the chosen device's ops with :func:`set_current_ops` before building a model.
"""

from __future__ import annotations

_current = None


def set_current_ops(ops) -> None:
    """Install the ops table every layer will use from now on (process-wide)."""
    global _current
    _current = ops


def current_ops():
    """The installed ops table; the plain-Paddle reference ops until one is installed."""
    global _current
    if _current is None:
        from fastdeploy_core.devices.reference_ops import ReferenceOps

        _current = ReferenceOps()
    return _current
