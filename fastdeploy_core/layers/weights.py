"""Helpers shared by the layers' weight loaders (checkpoint numpy array -> Paddle parameter)."""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from fastdeploy_core.errors import ModelLoadError


def new_parameter(layer: nn.Layer, shape: list[int], fill: float = 0.0) -> paddle.Tensor:
    """A float32 inference parameter (no gradient) of ``shape`` owned by ``layer``."""
    param = layer.create_parameter(shape, dtype="float32", default_initializer=nn.initializer.Constant(fill))
    param.stop_gradient = True
    return param


def replace_parameter(layer: nn.Layer, name: str, value: paddle.Tensor) -> paddle.Tensor:
    """Make ``layer.<name>`` a new inference parameter holding ``value`` (its shape and dtype)."""
    param = layer.create_parameter(list(value.shape), dtype=value.dtype, default_initializer=nn.initializer.Constant(0))
    param.stop_gradient = True
    param.set_value(value)
    setattr(layer, name, param)
    return param


def as_float32(loaded) -> np.ndarray:
    """A checkpoint tensor as a float32 numpy array (no copy when it already is one)."""
    return np.asarray(loaded, dtype=np.float32)


def copy_into(param: paddle.Tensor, loaded, what: str) -> None:
    """Copy ``loaded`` into ``param`` after checking the shapes match exactly."""
    array = as_float32(loaded)
    if tuple(param.shape) != tuple(array.shape):
        raise ModelLoadError(
            f"{what}: checkpoint tensor has shape {tuple(array.shape)}, the model expects "
            f"{tuple(param.shape)}; the checkpoint does not match its config.json"
        )
    param.set_value(array)


def release_weight_loaders(model) -> None:
    """Drop every parameter's ``weight_loader`` once the checkpoint is in.

    A loader is often a bound method (or closure) of its layer stored on the layer's own
    parameter: a reference cycle through a Paddle tensor, which Python's cycle collector cannot
    see into, so the layer and its weights outlived the model (SmolLM2's 108 MB embedding per
    engine a process created, measured). Loading is over; nothing calls them again.
    """
    for tensor in list(model.parameters()) + list(model.buffers()):
        if hasattr(tensor, "weight_loader"):
            try:
                delattr(tensor, "weight_loader")
            except AttributeError:
                pass
