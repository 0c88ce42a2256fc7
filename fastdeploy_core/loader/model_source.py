"""Where a model comes from: an HF directory or a GGUF file, and how its weights are read."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Literal

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.layers.weights import release_weight_loaders

_WHAT_TO_PASS = (
    "pass --model with an HF model directory (config.json + *.safetensors), a .gguf file or a "
    "directory holding one .gguf file, or omit --model to use the embedded default model"
)


@dataclass
class ModelSource:
    """A resolved model: its path, format and configs.

    ``path`` is the HF directory or the ``.gguf`` file itself; ``hf_config`` is the
    config.json content (built from metadata for GGUF); ``architecture`` is
    ``hf_config["architectures"][0]``.
    """

    path: str
    format: Literal["hf", "gguf"]
    hf_config: dict
    generation_config: dict = field(default_factory=dict)
    architecture: str = ""

    @property
    def directory(self) -> str:
        """The folder holding the model files (tokenizer files live here for HF models)."""
        return self.path if self.format == "hf" else os.path.dirname(self.path)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _gguf_source(path: str) -> ModelSource:
    from fastdeploy_core.loader.gguf_loader import gguf_to_hf_config

    config = gguf_to_hf_config(path)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    return ModelSource(path, "gguf", config, generation, config["architectures"][0])


def _hf_source(path: str) -> ModelSource:
    config = _read_json(os.path.join(path, "config.json"))
    architectures = config.get("architectures") or []
    if not architectures:
        raise ModelLoadError(
            f'{path}/config.json names no architectures; it must list the model class, e.g. ["<Name>ForCausalLM"]'
        )
    gen_path = os.path.join(path, "generation_config.json")
    generation = _read_json(gen_path) if os.path.isfile(gen_path) else {}
    return ModelSource(path, "hf", config, generation, architectures[0])


def resolve_model_source(model: str | None) -> ModelSource:
    """Resolve ``--model`` (``None`` = the embedded default GGUF) to a :class:`ModelSource`."""
    if model is None:
        from fastdeploy_core.default_model import default_model_path

        model = default_model_path()
    path = os.path.abspath(os.path.expanduser(str(model)))
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {model!r} does not exist; {_WHAT_TO_PASS}", param="model")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return _gguf_source(path)
        raise ModelLoadError(f"model file {model!r} is not a .gguf file; {_WHAT_TO_PASS}", param="model")
    if os.path.isfile(os.path.join(path, "config.json")):
        return _hf_source(path)
    ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
    if len(ggufs) == 1:
        return _gguf_source(os.path.join(path, ggufs[0]))
    if len(ggufs) > 1:
        raise ModelLoadError(
            f"directory {model!r} holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); pass one of them as --model",
            param="model",
        )
    raise ModelLoadError(
        f"directory {model!r} has neither config.json nor a .gguf file; {_WHAT_TO_PASS}", param="model"
    )


def iterate_weights(source: ModelSource, keep_blocks=None):
    """``(hf_name, float32 numpy array)`` pairs of the model's checkpoint.

    For GGUF sources, ``keep_blocks(hf_name, type_name)`` selects tensors passed on as raw
    quantized blocks (see :func:`fastdeploy_core.loader.gguf_loader.iterate_gguf`).
    """
    if source.format == "gguf":
        from fastdeploy_core.loader.gguf_loader import iterate_gguf

        return iterate_gguf(source.path, source.hf_config, keep_blocks=keep_blocks)
    from fastdeploy_core.loader.safetensors_loader import iterate_safetensors

    return iterate_safetensors(source.path)


def load_model_weights(model, source: ModelSource) -> None:
    """Feed the checkpoint of ``source`` into ``model.load_weights``.

    When the model was built with a quantizer that takes GGUF blocks as stored
    (``quant_config.gguf_block_filter(model)``), those tensors skip the float round trip.
    """
    keep_blocks = None
    quant_config = getattr(model, "quant_config", None)
    if source.format == "gguf" and hasattr(quant_config, "gguf_block_filter"):
        keep_blocks = quant_config.gguf_block_filter(model)
    model.load_weights(iterate_weights(source, keep_blocks=keep_blocks))
    release_weight_loaders(model)
