"""Multi-head latent attention (DeepSeek-V2/V3): a compressed KV cache of one latent row per token.

Per token, the hidden state is projected down to a latent ``c`` of ``kv_lora_rank`` numbers
(RMS-normalised) and one rotary key ``k_pe`` of ``qk_rope_head_dim`` shared by all heads; only
``[c, k_pe]`` is cached (:meth:`KVCacheLayout.latent`). Each head's key is ``[c @ w_k, k_pe]``
and its value ``c @ w_v`` (the ``kv_b_proj`` up-projection), which the ops table's
``mla_paged_attention`` either computes (prefill) or folds into the query and output sides
(decode). Queries come from a low-rank pair (``q_a_proj``, norm, ``q_b_proj``) when
``q_lora_rank`` is set, else from one ``q_proj``. With YaRN rope scaling the softmax scale is
multiplied by ``mscale(factor, mscale_all_dim)^2``, as transformers' ``modeling_deepseek_v3``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import paddle
from paddle import nn

from fastdeploy_core.devices.current import current_ops
from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.layers.linear import Linear
from fastdeploy_core.layers.norm import RMSNorm
from fastdeploy_core.layers.rotary import get_rope, rope_settings, yarn_mscale
from fastdeploy_core.layers.weights import as_float32, new_parameter

if TYPE_CHECKING:
    from fastdeploy_core.executor.forward_meta import ForwardMeta


class MLADims:
    """The MLA sizes of a DeepSeek-style config, checked against each other.

    Raises :class:`ModelLoadError` naming the fields when one is missing or they contradict.
    """

    def __init__(self, cfg: dict, family: str = "MLA"):
        def size(key: str, required: bool = True) -> int | None:
            value = cfg.get(key)
            if value is None:
                if required:
                    raise ModelLoadError(f"{family} config is missing {key!r}; is config.json complete?")
                return None
            if int(value) < 1 or int(value) != value:
                raise ModelLoadError(f"{family} config: {key} must be a positive integer, it is {value!r}")
            return int(value)

        self.hidden_size = size("hidden_size")
        self.num_heads = size("num_attention_heads")
        self.q_lora_rank = size("q_lora_rank", required=False)
        self.kv_lora_rank = size("kv_lora_rank")
        self.qk_nope_head_dim = size("qk_nope_head_dim")
        self.qk_rope_head_dim = size("qk_rope_head_dim")
        self.v_head_dim = size("v_head_dim")
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.qk_rope_head_dim % 2:
            raise ModelLoadError(
                f"{family} config: qk_rope_head_dim {self.qk_rope_head_dim} must be even (rotary pairs)"
            )
        declared = cfg.get("qk_head_dim")
        if declared is not None and int(declared) != self.qk_head_dim:
            raise ModelLoadError(
                f"{family} config: qk_head_dim {declared} is not qk_nope_head_dim {self.qk_nope_head_dim} + "
                f"qk_rope_head_dim {self.qk_rope_head_dim}; fix config.json"
            )
        self.attention_bias = bool(cfg.get("attention_bias", False))
        self.rms_norm_eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.max_positions = int(cfg.get("max_position_embeddings") or 2048)
        self.rope_theta, self.rope_scaling = rope_settings(cfg)
        #: rotary pairs interleaved (x0, x1), (x2, x3)... in the checkpoint's projections
        self.rope_interleave = bool(cfg.get("rope_interleave", False))
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling is not None and self.rope_scaling.get("mscale_all_dim"):
            mscale = yarn_mscale(float(self.rope_scaling["factor"]), float(self.rope_scaling["mscale_all_dim"]))
            scale = scale * mscale * mscale
        self.softmax_scale = scale


class LatentKVProjection(nn.Layer):
    """``kv_b_proj``: the latent -> (non-rotary key, value) up-projection of every head.

    Stored as ``weight [h, L, dn + dv]`` (the checkpoint's ``[h * (dn + dv), L]`` regrouped), the
    layout ``mla_paged_attention`` takes; float32 (quantizers do not apply: it is used inside
    the attention op, in both of its forms).
    """

    def __init__(self, dims: MLADims, prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.num_heads, self.rank = dims.num_heads, dims.kv_lora_rank
        self.width = dims.qk_nope_head_dim + dims.v_head_dim
        self.weight = new_parameter(self, [self.num_heads, self.rank, self.width])
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: paddle.Tensor, loaded, shard_id=None) -> None:
        array = as_float32(loaded)
        expected = (self.num_heads * self.width, self.rank)
        if tuple(array.shape) != expected:
            raise ModelLoadError(
                f"{self.prefix}.weight: checkpoint tensor of shape {tuple(array.shape)}, the config implies {expected} "
                "(num_attention_heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank); the checkpoint does not "
                "match its config.json"
            )
        param.set_value(array.reshape(self.num_heads, self.width, self.rank).transpose(0, 2, 1))


class MultiHeadLatentAttention(nn.Layer):
    """``forward(positions, hidden [T, H], kv_cache, meta) -> [T, H]`` over a latent cache.

    ``kv_cache`` is this layer's ``(latent_cache,)``, ``[num_blocks, block_size, 1, L + dr]``.
    Checkpoint names as transformers': ``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``.
    """

    def __init__(self, dims: MLADims, quant_config=None, prefix: str = ""):
        super().__init__()
        self.dims = dims
        h, bias = dims.num_heads, dims.attention_bias
        if dims.q_lora_rank is None:
            self.q_proj = Linear(dims.hidden_size, h * dims.qk_head_dim, False, quant_config, f"{prefix}.q_proj")
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(dims.hidden_size, dims.q_lora_rank, bias, quant_config, f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, dims.rms_norm_eps)
            self.q_b_proj = Linear(dims.q_lora_rank, h * dims.qk_head_dim, False, quant_config, f"{prefix}.q_b_proj")
        self.kv_a_proj_with_mqa = Linear(
            dims.hidden_size,
            dims.kv_lora_rank + dims.qk_rope_head_dim,
            bias,
            quant_config,
            f"{prefix}.kv_a_proj_with_mqa",
        )
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, dims.rms_norm_eps)
        self.kv_b_proj = LatentKVProjection(dims, prefix=f"{prefix}.kv_b_proj")
        self.o_proj = Linear(h * dims.v_head_dim, dims.hidden_size, bias, quant_config, f"{prefix}.o_proj")
        self.rotary_emb = get_rope(dims.qk_rope_head_dim, dims.max_positions, dims.rope_theta, dims.rope_scaling)

    def forward(self, positions: paddle.Tensor, hidden: paddle.Tensor, kv_cache, meta: ForwardMeta) -> paddle.Tensor:
        dims, ops = self.dims, current_ops()
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = paddle.split(
            q.reshape([-1, dims.num_heads, dims.qk_head_dim]), [dims.qk_nope_head_dim, dims.qk_rope_head_dim], axis=-1
        )
        c, k_pe = paddle.split(self.kv_a_proj_with_mqa(hidden), [dims.kv_lora_rank, dims.qk_rope_head_dim], axis=-1)
        q_pe, k_pe = ops.rotary_embedding(
            positions, q_pe, k_pe.reshape([-1, 1, dims.qk_rope_head_dim]), self.rotary_emb.cos_sin_cache
        )
        latent = paddle.concat([self.kv_a_layernorm(c), k_pe.reshape([-1, dims.qk_rope_head_dim])], axis=-1)
        out = ops.mla_paged_attention(
            paddle.concat([q_nope, q_pe], axis=-1),
            latent,
            kv_cache[0],
            meta,
            self.kv_b_proj.weight,
            dims.softmax_scale,
        )
        return self.o_proj(out)


def deinterleave_rope_rows(array, rope_dim: int, group: int):
    """Rows of an HF ``[out, in]`` projection (or its bias) whose outputs end each ``group`` rows
    with ``rope_dim`` rotary outputs in interleaved pairs, reordered to rotate-half order (even
    then odd). The interleaved rotation of ``x`` is the rotate-half rotation of that reorder, and
    a query and key reordered alike have the same dot products, so this is exact."""
    array = np.asarray(array)
    rows = array.shape[0]
    if rows % group:
        raise ModelLoadError(f"a projection of {rows} outputs does not split into groups of {group}")
    order = np.arange(rows).reshape(rows // group, group)
    rope = order[:, group - rope_dim :]
    order[:, group - rope_dim :] = np.concatenate([rope[:, 0::2], rope[:, 1::2]], axis=1)
    return array[order.reshape(-1)]
