"""Building blocks that model plugins compose: linear, attention, norm, rotary, activation, embedding.

Every layer computes through :func:`fastdeploy_core.devices.current.current_ops`, so a chip
plugin speeds up all models by overriding ops, and no layer branches on a device name.
"""
