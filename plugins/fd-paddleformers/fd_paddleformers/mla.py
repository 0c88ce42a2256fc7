"""DeepSeek's multi-head latent attention, as PaddleFormers 0.4 builds it, on the engine's paged cache.

PaddleFormers 0.4's ``DeepseekV2Attention`` (DeepSeek-V3 reuses it) projects each token's latent
up to per-head keys (``qk_nope_head_dim`` + ``qk_rope_head_dim``) and values (``v_head_dim``)
inside its forward, then hands them to its ``attn_func`` (the module-level
``scaled_dot_product_attention``), which calls the attention-function table. That wrapper:

* multiplies q by ``softmax_scale * sqrt(qk_head_dim)`` and also passes ``scaling=softmax_scale``:
  the kernel must apply ``qk_head_dim ** -0.5`` (what sdpa does by default); a kernel that honours
  ``scaling`` scales twice (0.4's eager kernel does: silently wrong);
* pads V with zeros from ``v_head_dim`` to ``qk_head_dim``, so q, k and v reach the attention
  function with one head dim, and keeps the first ``v_head_dim`` of each head's output;
* passes a fresh placeholder ``nn.Layer()`` as the attention's module, which cannot carry the
  fallback's binding: :func:`bind` wraps the module's ``attn_func`` so the binding is the active
  one for the duration of the call.

Its ``apply_rotary_pos_emb`` squeezes every unit axis out of cos/sin, the token axis too when a
step has one token (a lone decode): :func:`install_rotary` puts a form that reshapes instead in
the module (checked equal to the original on a multi-token input), for fallback steps only.

The module also reshapes the rotary key by ``self.seq_length`` (``config.seq_length``, fixed when
it is built, 4096 by default): :func:`set_step_length` sets it to the step's token count before
every step, since the engine's ragged batch has a different length each step.

The cache holds the expanded per-head K and the zero-padded V (the key/value layout with
``num_attention_heads`` heads of ``qk_head_dim``), not the latent: the latent never reaches the
attention function (the table hands it expanded K/V), and caching the latent would mean replacing
PaddleFormers' attention forward by our own MLA, which is what the native ``fd-deepseek`` is. It
costs ``2 * heads * qk_head_dim`` floats per token and layer instead of
``kv_lora_rank + qk_rope_head_dim``.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import paddle
from paddle import nn

from fd_paddleformers.attention import BINDING_ATTRIBUTE, PagedAttentionBinding, calling_with
from fd_paddleformers.rotary import in_fallback_step

_ROTARY_MARK = "_fd_mla_rotary_original"


#: families whose 0.4 modeling is PaddleFormers' DeepSeek-V2 attention
FAMILIES = ("DeepseekV2", "DeepseekV3")


def config_problem(family: str, hf_config: dict) -> str | None:
    """Why PaddleFormers 0.4's MLA would compute this checkpoint differently from transformers, or ``None``."""
    if family not in FAMILIES:
        return None
    if hf_config.get("rope_interleave") is False:
        return "its rotary pairs are not interleaved (rope_interleave: false); PaddleFormers' DeepSeek interleaves always"
    rope = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type != "yarn":
        return f"its rope is {rope_type!r}; PaddleFormers' DeepSeek builds only YaRN rotary embeddings"
    return None


def drop_unused_norm(model: nn.Layer) -> None:
    """Without a low-rank query (``q_lora_rank: null``) PaddleFormers still builds ``q_a_layernorm``,
    which its forward never calls and no checkpoint holds: remove it."""
    for layer in getattr(model, "layers", None) or []:
        attn = getattr(layer, "self_attn", None)
        if attn is not None and is_latent_attention(attn) and attn.q_lora_rank is None:
            attn._sub_layers.pop("q_a_layernorm", None)


def is_latent_attention(module: nn.Layer) -> bool:
    """PaddleFormers' MLA modules: per-head dims ``q_head_dim``/``v_head_dim`` and a swappable ``attn_func``."""
    return all(hasattr(module, name) for name in ("q_head_dim", "v_head_dim", "kv_b_proj", "attn_func", "seq_length"))


def cache_dims(module: nn.Layer) -> tuple[int, int]:
    """``(kv heads, head dim)`` of the cache: every head's own K and padded V of ``qk_head_dim``."""
    return int(module.num_heads), int(module.q_head_dim)


def kernel_scale(module: nn.Layer) -> float:
    """The paged kernel's scale: q arrives already multiplied by ``softmax_scale * sqrt(qk_head_dim)``."""
    return float(module.q_head_dim) ** -0.5


def bind(module: nn.Layer, binding: PagedAttentionBinding) -> None:
    """Give ``module`` its binding, and make it the active one while its ``attn_func`` runs."""
    setattr(module, BINDING_ATTRIBUTE, binding)
    original = module.attn_func
    if getattr(original, "_fd_bound", None) is not None:
        original = original._fd_bound

    @functools.wraps(original)
    def attn_func(*args, **kwargs):
        with calling_with(binding):
            return original(*args, **kwargs)

    attn_func._fd_bound = original
    module.attn_func = attn_func


def set_step_length(modules: list[nn.Layer], num_tokens: int) -> None:
    """Point every MLA module's reshape at this step's token count (batch 1, ``[1, T, ...]``)."""
    for module in modules:
        module.seq_length = num_tokens


def _rotary(rotate_half):
    def apply(q, k, cos, sin):
        """``q [1, T, h, d]``, ``k [1, T, h', d]`` with interleaved pairs; ``cos``/``sin`` hold ``[T, d]`` (batch 1)."""
        out = []
        for x in (q, k):
            b, t, h, d = x.shape
            x = x.reshape([b, t, h, d // 2, 2]).transpose([0, 1, 2, 4, 3]).reshape([b, t, h, d])
            c, s = cos.reshape([b, t, 1, d]), sin.reshape([b, t, 1, d])
            out.append(x * c + rotate_half(x) * s)
        return tuple(out)

    return apply


def install_rotary(module_name: str) -> bool:
    """Swap the module's ``apply_rotary_pos_emb`` for one that keeps a one-token axis; True if it is now.

    The replacement runs only inside fallback steps with batch 1 and ``position_ids`` given,
    and is installed only if it equals the original on a 5-token input.
    """
    module = sys.modules.get(module_name)
    original = getattr(module, "apply_rotary_pos_emb", None)
    rotate_half = getattr(module, "rotate_half", None)
    if original is None or rotate_half is None:
        return False
    if hasattr(original, _ROTARY_MARK):
        return True
    form = _rotary(rotate_half)
    rng = np.random.default_rng(0)
    q = paddle.to_tensor(rng.standard_normal((1, 5, 3, 8)).astype(np.float32))
    k = paddle.to_tensor(rng.standard_normal((1, 5, 3, 8)).astype(np.float32))
    angles = rng.uniform(0, 6, (1, 5, 4)).astype(np.float32)
    angles = np.concatenate([angles, angles], axis=-1)[None, :, None]  # as the attention hands them: [1, 1, 1, T, d]
    cos, sin = paddle.to_tensor(np.cos(angles)), paddle.to_tensor(np.sin(angles))
    try:
        want = original(q, k, cos, sin, paddle.arange(5).unsqueeze(0), False)
    except Exception:  # another signature: not the form this replaces
        return False
    got = form(q, k, cos, sin)
    if not all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(want, got)):
        return False

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, fuse_rope=False):
        if position_ids is None or fuse_rope or q.shape[0] != 1 or not in_fallback_step():
            return original(q, k, cos, sin, position_ids, fuse_rope)
        return form(q, k, cos, sin)

    setattr(apply_rotary_pos_emb, _ROTARY_MARK, original)
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True
