"""Read HF ``*.safetensors`` checkpoints as ``(name, float32 numpy array)`` pairs.

The format is parsed here (8-byte header length, JSON header, raw data) so that bf16/f16
convert to float32 without torch, and so a truncated or corrupt file fails with an error
naming the file instead of a crash deep inside a reader.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator

import numpy as np

from fastdeploy_core.errors import ModelLoadError

_NUMPY_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def safetensors_files(model_dir: str) -> list[str]:
    """Sorted ``*.safetensors`` paths in ``model_dir``; ModelLoadError when there are none."""
    try:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    except OSError as exc:
        raise ModelLoadError(f"cannot list model directory {model_dir}: {exc}") from None
    if not names:
        raise ModelLoadError(
            f"no *.safetensors files in {model_dir}; pass an HF model directory with safetensors "
            "weights (PyTorch .bin checkpoints are not supported) or a .gguf file"
        )
    return [os.path.join(model_dir, n) for n in names]


def _read_header(path: str, size: int) -> tuple[dict, int]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path} is not a safetensors file: it is only {size} bytes long")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise ModelLoadError(
                f"{path} is corrupt or truncated: header claims {header_len} bytes but the file has {size}"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is corrupt: its safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path} is corrupt: its safetensors header is not a JSON object")
    return header, 8 + header_len


def _to_float32(path: str, name: str, dtype: str, shape: list[int], buf: np.ndarray) -> np.ndarray:
    if dtype == "BF16":
        bits = buf.view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        raise ModelLoadError(f"{path}: tensor {name} has dtype {dtype}, which the loader cannot convert")
    array = buf.view(np_dtype).reshape(shape)
    if np.issubdtype(np_dtype, np.floating):
        return array.astype(np.float32, copy=False)
    return array


def iterate_safetensors_file(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` for every tensor of one file; floating tensors come out float32."""
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    header, data_start = _read_header(path, size)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=0, shape=(size,)) if size else np.zeros(0, np.uint8)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            shape = [int(s) for s in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{path} is corrupt: bad header entry for tensor {name!r}") from None
        if not (0 <= begin <= end) or data_start + end > size:
            raise ModelLoadError(
                f"{path} is corrupt or truncated: tensor {name} needs bytes up to {data_start + end}, "
                f"the file has {size}"
            )
        buf = np.array(data[data_start + begin : data_start + end])
        itemsize = 2 if dtype == "BF16" else np.dtype(_NUMPY_DTYPES.get(dtype, np.uint8)).itemsize
        if buf.size != itemsize * int(np.prod(shape, dtype=np.int64)):
            raise ModelLoadError(f"{path} is corrupt: tensor {name} has {buf.size} bytes for shape {shape} {dtype}")
        yield name, _to_float32(path, name, dtype, shape, buf)


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, float32 array)`` over all ``*.safetensors`` files of an HF model directory."""
    for path in safetensors_files(model_dir):
        yield from iterate_safetensors_file(path)
