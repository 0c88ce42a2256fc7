"""Conformance kit for device plugins.

Run it against a registered device::

    pytest -p fastdeploy_core.testing.pytest_plugin --fd-device=mychip
    pytest -p fastdeploy_core.testing.pytest_plugin --fd-device=mychip --fd-place=cpu   # no chip here

The checks live in :mod:`fastdeploy_core.testing.checks` and can also be called directly.
"""
