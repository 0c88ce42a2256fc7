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
