"""Read GGUF files: metadata -> an HF-style config, tensors -> HF-named float32 arrays.

Only Llama-architecture GGUFs are mapped so far. llama.cpp stores ``attn_q``/``attn_k`` rows
permuted for its interleaved RoPE; they are un-permuted here so the HF rotate_half
convention of the model layers applies unchanged.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable, Iterator

import numpy as np

from fastdeploy_core.errors import ModelLoadError, UnsupportedArchitectureError

#: GGUF ``general.architecture`` -> HF architecture class name
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
#: tensors consumed through the config (rope_freqs) or carrying nothing we use
_SKIPPED_TENSORS = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

_readers: dict[tuple, object] = {}


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
_readers_lock = threading.Lock()


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
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # an odd field should not block loading the rest
            continue
    return meta


def gguf_architecture(meta: dict, path: str) -> tuple[str, str]:
    """``(gguf_arch, hf_architecture)``; UnsupportedArchitectureError for unmapped archs."""
    arch = meta.get("general.architecture")
    if not arch:
        raise ModelLoadError(f"{path} has no general.architecture metadata; is it a model GGUF?")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} of {path} is not supported; supported GGUF architectures: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}. Convert the model to an HF safetensors directory "
            "to use another model plugin"
        )
    return arch, GGUF_ARCHITECTURES[arch]


def _llama3_scaling_from_freqs(freq_factors: np.ndarray, head_dim: int, theta: float) -> dict | None:
    """Recover Llama-3 rope scaling parameters from llama.cpp's ``rope_freqs`` tensor."""
    from fastdeploy_core.layers.rotary import compute_inv_freq

    factor = float(np.max(freq_factors))
    base = compute_inv_freq(head_dim, theta, None)
    for original in (8192, 4096, 16384, 32768):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            scaling = {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
            implied = base / compute_inv_freq(head_dim, theta, scaling)
            if np.allclose(implied, freq_factors, rtol=1e-3, atol=1e-3):
                return scaling
    return None


def gguf_to_hf_config(path: str) -> dict:
    """An HF-style config dict built from the GGUF metadata of ``path``."""
    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    arch, hf_arch = gguf_architecture(meta, path)

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    try:
        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        config = {
            "architectures": [hf_arch],
            "model_type": arch,
            "hidden_size": hidden,
            "intermediate_size": int(get("feed_forward_length")),
            "num_hidden_layers": int(get("block_count")),
            "num_attention_heads": heads,
        }
    except (TypeError, ValueError):
        raise ModelLoadError(f"{path} lacks the {arch}.* hyper-parameters (embedding_length, block_count, ...)") from None
    tensor_names = {t.name for t in reader.tensors}
    vocab = get("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab = int(embd.shape[-1])
    head_dim = int(get("attention.key_length") or hidden // heads)
    config.update(
        num_key_value_heads=int(get("attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        vocab_size=int(vocab),
        tie_word_embeddings="output.weight" not in tensor_names,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        torch_dtype="float32",
    )
    for key, hf_key in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.padding_token_id", "pad_token_id"),
    ):
        if key in meta:
            config[hf_key] = int(meta[key])
    scaling_type = get("rope.scaling.type")
    if scaling_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"{path}: rope scaling type {scaling_type!r} is not supported (linear and llama3 are)")
    if "rope_freqs.weight" in tensor_names:
        freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        factors = _dequantize(path, freqs).reshape(-1)
        scaling = _llama3_scaling_from_freqs(factors, head_dim, config["rope_theta"])
        if scaling is None:
            raise ModelLoadError(f"{path}: its rope_freqs tensor matches no known Llama-3 rope scaling")
        config["rope_scaling"] = scaling
    return config


def _dequantize(path: str, tensor) -> np.ndarray:
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


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row order of attn_q / attn_k ``[out, in]``."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, ``None`` for tensors that are skipped."""
    if gguf_name in _SKIPPED_TENSORS:
        return None
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
    return gguf_name  # unknown: passed through so the model reports it by name


def iterate_gguf(
    path: str,
    hf_config: dict | None = None,
    keep_blocks: Callable[[str, str], bool] | None = None,
) -> Iterator[tuple[str, object]]:
    """``(hf_name, float32 array [out, in])`` for every tensor of a Llama GGUF file.

    ``keep_blocks(hf_name, type_name)`` (from the active quantizer's ``gguf_block_filter``)
    selects tensors handed over as raw :class:`~fastdeploy_core.quantization.gguf.GGUFBlocks`
    instead of being dequantized; Q/K rows are un-permuted either way.
    """
    reader = open_gguf(path)
    config = hf_config or gguf_to_hf_config(path)
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        expected = tuple(int(d) for d in reversed(tensor.shape))
        heads = None
        if name.endswith("self_attn.q_proj.weight"):
            heads = num_heads
        elif name.endswith("self_attn.k_proj.weight"):
            heads = num_kv_heads
        if keep_blocks is not None and len(expected) == 2 and keep_blocks(name, tensor.tensor_type.name):
            from fastdeploy_core.quantization.gguf import GGUFBlocks

            blocks = GGUFBlocks(tensor.tensor_type.name, np.asarray(tensor.data), expected)
            yield name, (blocks.unpermute_heads(heads) if heads else blocks)
            continue
        array = _dequantize(path, tensor)
        if int(np.prod(array.shape)) != math.prod(expected):
            raise ModelLoadError(f"{path}: tensor {tensor.name} dequantized to {array.shape}, expected {expected}")
        array = array.reshape(expected)
        if heads:
            array = _unpermute(array, heads)
        yield name, array
