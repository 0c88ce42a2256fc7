"""Rotary position embedding: the cos/sin cache, with Llama-3, linear and YaRN rope scaling.

Follows transformers' Llama conventions exactly (float32 ``inv_freq``, rotate_half layout,
``_compute_llama3_parameters``), so logits match the reference to float32 rounding.
Config is read from either transformers-4 keys (``rope_theta``, ``rope_scaling``) or
transformers-5 ``rope_parameters``.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
from paddle import nn

from fastdeploy_core.devices.current import current_ops
from fastdeploy_core.errors import ModelLoadError


def rope_settings(hf_config: dict) -> tuple[float, dict | None]:
    """``(rope_theta, scaling)`` of an HF config; ``scaling`` is ``None`` for plain RoPE."""
    params = hf_config.get("rope_parameters") or {}
    theta = float(hf_config.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = hf_config.get("rope_scaling") or None
    if scaling is None and params:
        scaling = params
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
        else:
            scaling = dict(scaling, rope_type=rope_type)
    return theta, scaling


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """float32 inverse frequencies ``[head_dim / 2]`` after rope scaling."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = (np.float32(2 * math.pi) / inv_freq).astype(np.float32)
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
        smooth = ((old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)).astype(
            np.float32
        )
        smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ModelLoadError(f"rope scaling type {rope_type!r} is not supported; supported: default, linear, llama3, yarn")


def _yarn_scaling_value(scaling: dict, key: str):
    value = scaling.get(key)
    if value is None:
        raise ModelLoadError(f"YaRN rope scaling needs {key!r} in rope_parameters / rope_scaling; fix config.json")
    return value


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``factor`` times: ``0.1 mscale ln(factor) + 1``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor YaRN multiplies cos and sin by (1 for the other types): ``attention_factor`` when
    given, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else
    ``mscale(factor)``, as transformers' ``_compute_yarn_parameters``."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(_yarn_scaling_value(scaling, "factor"))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """YaRN: high frequencies kept, low ones divided by ``factor``, a linear ramp between the
    dimensions of ``beta_fast`` and ``beta_slow`` rotations over the original context."""
    factor = np.float32(_yarn_scaling_value(scaling, "factor"))
    original = float(_yarn_scaling_value(scaling, "original_max_position_embeddings"))
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    pos_freqs = (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))).astype(
        np.float32
    )
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (factor * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1.0) - ramp.astype(np.float32)).astype(np.float32)
    return (interpolation * (np.float32(1.0) - keep) + extrapolation * keep).astype(np.float32)


def build_cos_sin_cache(head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> np.ndarray:
    """``[max_positions, 2, head_dim]`` float32: row 0 ``cos``, row 1 ``[-sin, sin]`` (signed).

    With the signed sine, ``x * cos + rotate_half(x) * sin`` is ``x * cos + roll(x, d/2) * sin_signed``.
    """
    inv_freq = compute_inv_freq(head_dim, theta, scaling)
    positions = np.arange(max_positions, dtype=np.float32)
    freqs = (positions[:, None] * inv_freq[None, :]).astype(np.float32)  # [P, d/2]
    attention_factor = np.float32(rope_attention_factor(scaling))
    cos = (np.cos(freqs).astype(np.float32) * attention_factor).astype(np.float32)
    sin = (np.sin(freqs).astype(np.float32) * attention_factor).astype(np.float32)
    cache = np.empty((max_positions, 2, head_dim), dtype=np.float32)
    cache[:, 0, :] = np.concatenate([cos, cos], axis=-1)
    cache[:, 1, :] = np.concatenate([-sin, sin], axis=-1)
    return cache


class RotaryEmbedding(nn.Layer):
    """Applies RoPE to ``q [T, h, d]`` and ``k [T, kvh, d]`` at ``positions [T]``."""

    def __init__(self, head_dim: int, max_positions: int, theta: float = 10000.0, scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = int(max_positions)
        cache = build_cos_sin_cache(head_dim, self.max_positions, theta, scaling)
        self.register_buffer("cos_sin_cache", paddle.to_tensor(cache), persistable=False)

    def forward(self, positions: paddle.Tensor, q: paddle.Tensor, k: paddle.Tensor | None):
        return current_ops().rotary_embedding(positions, q, k, self.cos_sin_cache)


_SHARED_CACHES: dict[tuple, RotaryEmbedding] = {}


def get_rope(head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> RotaryEmbedding:
    """One :class:`RotaryEmbedding` per distinct setting, shared by all layers of a model.

    Sharing the cache tensor also lets the ops reuse one per-step cos/sin gather across layers.
    """
    key = (head_dim, int(max_positions), float(theta), tuple(sorted((scaling or {}).items())))
    rope = _SHARED_CACHES.get(key)
    if rope is None:
        rope = RotaryEmbedding(head_dim, max_positions, theta, scaling)
        _SHARED_CACHES[key] = rope
    return rope
