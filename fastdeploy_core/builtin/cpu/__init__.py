"""The cpu device: one room for everything it is made of.

``device.py`` (the :class:`~fastdeploy_core.devices.base.Device` declaration), ``ops.py`` (its
ops table), ``kernels.py`` (the build of ``csrc/``, its C++ kernels), ``layout.py`` (the packed
weight layouts those kernels read) and ``process_env.py`` (thread and MKL settings that must be
in the environment before Paddle loads). Importing this package imports none of them.
"""
