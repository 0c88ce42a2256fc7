"""Read GGUF files: metadata -> an HF-style config, tensors -> HF-named float32 arrays.

The loader knows the file format, not the models: which GGUF ``general.architecture`` loads as
which HF architecture, how tensors are named and what the metadata means come from the model
plugin that registered that architecture (``register_models`` with
``gguf=GGUFArchitecture(...)``, see :class:`fastdeploy_core.hookspecs.GGUFArchitecture`).
A file of an architecture nobody registered fails with the list of registered ones.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.loader.gguf_blocks import GGUFBlocks, dequantize_tensor

_readers: dict[tuple, object] = {}
_readers_lock = threading.Lock()


def _fast_reader_class():
    """``gguf.GGUFReader`` reading its header through a plain ndarray view of the file map.

    The stock reader slices the ``np.memmap`` itself for each of the ~200k header items of a
    vocabulary (49k tokens + merges); every memmap slice pays ``memmap.__array_finalize__``,
    which makes parsing take seconds. Slicing a plain view of the same mapping is identical
    data at a fraction of the cost. Falls back to the stock reader if gguf changes ``_get``.
    """
    import gguf

    class FastGGUFReader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain_data")
            if plain is None:
                plain = self._plain_data = self.data.view(np.ndarray)
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            arr = plain[offset:end].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return FastGGUFReader


def open_gguf(path: str):
    """A ``gguf.GGUFReader`` for ``path`` (cached per file version); ModelLoadError if unreadable."""
    import gguf

    try:
        stat = os.stat(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None
    key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    with _readers_lock:
        reader = _readers.get(key)
        if reader is not None:
            return reader
        try:
            try:
                reader = _fast_reader_class()(path)
            except TypeError:  # a gguf release whose private _get differs: use the stock reader
                reader = gguf.GGUFReader(path)
        except Exception as exc:  # the reader raises ValueError, struct/numpy errors, KeyError...
            raise ModelLoadError(
                f"{path} is not a readable GGUF file (corrupt or truncated?): {type(exc).__name__}: {exc}"
            ) from None
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
        if end > stat.st_size:
            raise ModelLoadError(f"{path} is truncated: its tensors need {end} bytes, the file has {stat.st_size}")
        _readers.clear()  # keep one file mapped at a time
        _readers[key] = reader
        return reader


def close_gguf_readers() -> None:
    """Forget the cached reader, unmapping its file once nothing else holds its arrays.

    Called after a model's weights are in place: the map would otherwise keep every page of the
    file the loader touched (the whole file, ~96 MB for the default model) in the process.
    """
    with _readers_lock:
        _readers.clear()


def gguf_metadata(reader) -> dict:
    """All scalar and string metadata of a GGUF file (arrays except small ones are skipped)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if key in (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.scores",
        ):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # an odd field should not block loading the rest
            continue
    return meta


class GGUFFile:
    """What a model plugin's ``hf_config`` translation reads from one GGUF file.

    ``metadata`` holds every scalar and string key (the tokenizer's big arrays left out);
    :meth:`get` reads the keys under the file's architecture prefix (``<architecture>.block_count``);
    shapes and tensors are in HF orientation (``[out, in]``).
    """

    def __init__(self, path: str, reader, metadata: dict):
        self.path = path
        self.metadata = metadata
        self.architecture = str(metadata.get("general.architecture", ""))
        self._reader = reader
        self._tensors = {t.name: t for t in reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        """``metadata["<architecture>.<key>"]`` or ``default``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def tensor_names(self) -> frozenset[str]:
        """The GGUF names of all tensors in the file."""
        return frozenset(self._tensors)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` in HF orientation (GGUF lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self._tensor(name).shape))

    def read_tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` dequantized to float32 in HF orientation (for small tensors like ``rope_freqs``)."""
        return dequantize_tensor(self.path, self._tensor(name)).reshape(self.tensor_shape(name))

    @property
    def token_count(self) -> int | None:
        """Entries of ``tokenizer.ggml.tokens`` (the vocabulary), ``None`` without a vocabulary."""
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        return len(tokens.data) if tokens is not None else None

    def _tensor(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelLoadError(f"{self.path} has no tensor {name!r}") from None


class _TensorNames:
    """A plugin's GGUF -> HF tensor-name map, ``{bid}`` templates compiled to patterns."""

    def __init__(self, mapping: Mapping[str, str | None]):
        self.exact = {k: v for k, v in mapping.items() if "{bid}" not in k}
        self.per_layer = [
            (re.compile("^" + re.escape(k).replace(re.escape("{bid}"), r"(?P<bid>\d+)") + "$"), v)
            for k, v in mapping.items()
            if "{bid}" in k
        ]

    @staticmethod
    def _split(gguf_name: str) -> tuple[str, str]:
        base, _, kind = gguf_name.rpartition(".")
        return (base, f".{kind}") if kind in ("weight", "bias") else (gguf_name, "")

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF name, ``None`` for skipped tensors; unknown names pass through for the model to report."""
        base, suffix = self._split(gguf_name)
        if base in self.exact:
            hf = self.exact[base]
            return None if hf is None else hf + suffix
        for pattern, template in self.per_layer:
            match = pattern.match(base)
            if match:
                return None if template is None else template.format(bid=match["bid"]) + suffix
        return gguf_name

    def is_layer_weight(self, gguf_name: str) -> bool:
        """Whether ``gguf_name`` is a mapped per-layer (``{bid}``) weight."""
        base, suffix = self._split(gguf_name)
        return suffix == ".weight" and any(p.match(base) and t is not None for p, t in self.per_layer)


@dataclass
class _Architecture:
    """A registered GGUF architecture with its ``"module:attr"`` parts imported."""

    name: str
    hf_architecture: str
    distribution: str
    tensor_names: _TensorNames
    hf_config: Callable[[GGUFFile], dict]
    row_order: Callable[[str, int, dict], Any] | None


def _architecture_name(reader, path: str) -> str:
    field = reader.fields.get("general.architecture")
    try:
        arch = field.contents() if field is not None else None
    except Exception:  # a malformed field reads as missing
        arch = None
    if not arch:
        raise ModelLoadError(f"{path} has no general.architecture metadata; is it a model GGUF?")
    return str(arch)


def gguf_architecture(reader, path: str, plugin_manager=None) -> _Architecture:
    """The registered architecture of the GGUF file ``path``; UnsupportedArchitectureError if none."""
    from fastdeploy_core.plugins import get_plugin_manager, import_target

    manager = plugin_manager or get_plugin_manager()
    name = _architecture_name(reader, path)
    hf_architecture, spec = manager.gguf_architecture(name, path)
    distribution = manager.gguf_architectures.entry(name).distribution

    def part(value):
        try:
            return import_target(value)
        except Exception as exc:  # the plugin's module is broken: say whose
            raise ModelLoadError(
                f"GGUF architecture {name!r} is registered by {distribution}, whose {value!r} cannot be imported "
                f"({type(exc).__name__}: {exc}); reinstall {distribution}"
            ) from None

    return _Architecture(
        name,
        hf_architecture,
        distribution,
        _TensorNames(part(spec.tensor_names)),
        part(spec.hf_config),
        part(spec.row_order) if spec.row_order is not None else None,
    )


def gguf_to_hf_config(path: str, plugin_manager=None) -> dict:
    """An HF-style config dict built from the GGUF metadata of ``path`` by its architecture's plugin."""
    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    arch = gguf_architecture(reader, path, plugin_manager)
    try:
        translated = arch.hf_config(GGUFFile(path, reader, meta))
    except ModelLoadError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(
            f"{path}: its {arch.name} metadata does not make a config ({type(exc).__name__}: {exc}); "
            f"is the file complete? (translation by {arch.distribution})"
        ) from None
    config = {"architectures": [arch.hf_architecture], **translated}
    config.setdefault("torch_dtype", "float32")  # every tensor is dequantized to float32 or kept as blocks
    for key, hf_key in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.padding_token_id", "pad_token_id"),
    ):
        if key in meta:
            config[hf_key] = int(meta[key])
    return config


def linear_tensor_types(path: str, plugin_manager=None) -> set[str]:
    """GGUF types (``"Q4_1"``, ``"F32"``...) of the linear-layer weights of the GGUF file ``path``.

    Linear weights are the 2-D per-layer weights of the architecture's tensor map (norms are
    1-D, embeddings are not per layer); a quantizer picks its storage layout from these types.
    """
    reader = open_gguf(path)
    names = gguf_architecture(reader, path, plugin_manager).tensor_names
    return {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2 and names.is_layer_weight(t.name)}


def iterate_gguf(
    path: str,
    hf_config: dict | None = None,
    keep_blocks: Callable[[str, str], bool] | None = None,
    plugin_manager=None,
) -> Iterator[tuple[str, object]]:
    """``(hf_name, float32 array [out, in])`` for every tensor of a GGUF file.

    ``keep_blocks(hf_name, type_name)`` (from the active quantizer's ``gguf_block_filter``)
    selects tensors handed over as raw :class:`~fastdeploy_core.loader.gguf_blocks.GGUFBlocks`
    instead of being dequantized; the plugin's ``row_order`` applies either way.
    """
    reader = open_gguf(path)
    arch = gguf_architecture(reader, path, plugin_manager)
    config = hf_config or gguf_to_hf_config(path, plugin_manager)
    for tensor in reader.tensors:
        name = arch.tensor_names.hf_name(tensor.name)
        if name is None:
            continue
        expected = tuple(int(d) for d in reversed(tensor.shape))
        order = arch.row_order(name, expected[0], config) if arch.row_order is not None else None
        if keep_blocks is not None and len(expected) == 2 and keep_blocks(name, tensor.tensor_type.name):
            blocks = GGUFBlocks(tensor.tensor_type.name, np.asarray(tensor.data), expected)
            yield name, (blocks if order is None else blocks.permute_rows(order))
            continue
        array = dequantize_tensor(path, tensor)
        if int(np.prod(array.shape)) != math.prod(expected):
            raise ModelLoadError(f"{path}: tensor {tensor.name} dequantized to {array.shape}, expected {expected}")
        array = array.reshape(expected)
        yield name, (array if order is None else array[order])
