"""GGUF tensor data: raw quantized blocks kept as stored, or decoded to float32.

A GGUF loader that knows the active quantizer hands a linear weight over as
:class:`GGUFBlocks` (raw block bytes, HF orientation ``[out, in]``) instead of dequantizing
it, when the quantizer's storage can hold those blocks as they are (the conversions live in
:mod:`fastdeploy_core.quantization.gguf`). GGUF blocks run along the input axis, 32 values
each, so reordering whole output rows (:meth:`GGUFBlocks.permute_rows`) never splits a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy_core.errors import ModelLoadError

#: values per block along the input axis for the types taken as stored
BLOCK = 32
#: bytes per block: float16 scale (+ float16 min for Q4_1) + the packed values
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


@dataclass
class GGUFBlocks:
    """One GGUF tensor's raw blocks: ``data uint8 [out, in / 32 * block_bytes]``, ``shape (out, in)``."""

    type_name: str
    data: np.ndarray
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if self.type_name not in BLOCK_BYTES:
            raise ModelLoadError(f"GGUF block type {self.type_name} cannot be taken directly; dequantize it instead")
        out, inp = self.shape
        if inp % BLOCK:
            raise ModelLoadError(f"GGUF tensor of shape {self.shape}: the input size is not a multiple of {BLOCK}")
        row_bytes = inp // BLOCK * BLOCK_BYTES[self.type_name]
        data = np.ascontiguousarray(self.data, dtype=np.uint8)
        if data.size != out * row_bytes:
            raise ModelLoadError(
                f"GGUF {self.type_name} tensor of shape {self.shape} holds {data.size} bytes, expected {out * row_bytes}"
            )
        self.data = data.reshape(out, row_bytes)

    def blocks(self) -> np.ndarray:
        """``[out, in / 32, block_bytes]`` view of the raw data."""
        out, inp = self.shape
        return self.data.reshape(out, inp // BLOCK, BLOCK_BYTES[self.type_name])

    def permute_rows(self, order: np.ndarray) -> GGUFBlocks:
        """The same tensor with its output rows taken in ``order`` (a model plugin's ``row_order``)."""
        return GGUFBlocks(self.type_name, self.data[order], self.shape)

    def take_rows(self, start: int, stop: int) -> GGUFBlocks:
        """Output rows ``[start, stop)`` (a tensor-parallel rank's share of a column-parallel layer)."""
        return GGUFBlocks(self.type_name, self.data[start:stop], (stop - start, self.shape[1]))

    def take_columns(self, start: int, stop: int) -> GGUFBlocks:
        """Inputs ``[start, stop)`` (a row-parallel layer's share); whole blocks only."""
        if start % BLOCK or stop % BLOCK:
            raise ModelLoadError(
                f"GGUF {self.type_name} tensor of shape {self.shape}: inputs {start}:{stop} split a block of {BLOCK}; "
                "use another tensor parallel size"
            )
        blocks = self.blocks()[:, start // BLOCK:stop // BLOCK]
        return GGUFBlocks(self.type_name, blocks.reshape(self.shape[0], -1), (self.shape[0], stop - start))

    def dequantize(self) -> np.ndarray:
        """Float32 ``[out, in]`` (through gguf-py), for storage that cannot hold the blocks."""
        from gguf import GGMLQuantizationType, quants

        values = quants.dequantize(self.data, GGMLQuantizationType[self.type_name])
        return np.asarray(values, dtype=np.float32).reshape(self.shape)


def dequantize_tensor(path: str, tensor) -> np.ndarray:
    """Float32 values of a ``gguf.ReaderTensor`` of ``path`` (gguf's shape); ModelLoadError naming it."""
    from gguf import quants

    try:
        array = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} uses quantization {tensor.tensor_type.name}, which cannot be dequantized here"
        ) from None
    except Exception as exc:
        raise ModelLoadError(f"{path}: tensor {tensor.name} is corrupt ({type(exc).__name__}: {exc})") from None
    return np.asarray(array, dtype=np.float32)
