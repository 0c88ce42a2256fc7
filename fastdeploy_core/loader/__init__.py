"""Model loading: resolve ``--model`` to a source, read safetensors or GGUF weights."""

from fastdeploy_core.loader.gguf_blocks import GGUFBlocks
from fastdeploy_core.loader.gguf_loader import GGUFFile, gguf_to_hf_config, iterate_gguf
from fastdeploy_core.loader.model_source import ModelSource, iterate_weights, load_model_weights, resolve_model_source
from fastdeploy_core.loader.safetensors_loader import iterate_safetensors

__all__ = [
    "GGUFBlocks",
    "GGUFFile",
    "ModelSource",
    "gguf_to_hf_config",
    "iterate_gguf",
    "iterate_safetensors",
    "iterate_weights",
    "load_model_weights",
    "resolve_model_source",
]
