"""Tokenizers: HF ``tokenizers`` from tokenizer.json or rebuilt from GGUF metadata, and chat templates."""

from __future__ import annotations

from fastdeploy_core.tokenizer.tokenizer import Tokenizer


def load_tokenizer(source) -> Tokenizer:
    """The tokenizer of a resolved :class:`~fastdeploy_core.loader.ModelSource`."""
    if source.format == "gguf":
        from fastdeploy_core.tokenizer.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(source.path)
    from fastdeploy_core.tokenizer.hf_tokenizer import load_hf_tokenizer

    return load_hf_tokenizer(source.path, source.generation_config)


__all__ = ["Tokenizer", "load_tokenizer"]
