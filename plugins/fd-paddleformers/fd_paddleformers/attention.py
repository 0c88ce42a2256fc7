"""PaddleFormers attention routed into the core's paged attention.

PaddleFormers' attention modules look their kernel up by name in a table,
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``, and call it with the query, key and
value (RoPE already applied, batch 1, laid out ``[1, T, heads, d]`` by PaddleFormers 0.4 and
``[1, heads, T, d]`` by 1.x: the generation adapter turns them into ``[T, heads, d]``) and the
module itself. The fallback builds models with ``_attn_implementation`` set to
:data:`ATTENTION_IMPLEMENTATION` and registers :func:`paged_attention_forward` under that
name: it writes the step's K/V into the engine's paged cache and attends over the whole
cached context through the core :class:`~fastdeploy_core.layers.attention.Attention` layer,
so prefix caching and chunked prefill behave exactly as for native models.

Each PaddleFormers attention module is given a :class:`PagedAttentionBinding` (its layer
index, the core attention layer and the model's :class:`StepContext`); the model fills the
step context with the step's ``ForwardMeta`` and KV caches before running the decoder.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import paddle

from fastdeploy_core.layers.attention import Attention

#: the name under which the paged attention is registered in PaddleFormers' table
ATTENTION_IMPLEMENTATION = "fastdeploy_paged"
#: attribute of a PaddleFormers attention module that holds its binding
BINDING_ATTRIBUTE = "fd_paged_attention"


@dataclass
class StepContext:
    """What one forward step hands to every attention module of one model."""

    meta: Any = None
    kv_caches: Any = None
    #: attention calls in this step: every decoder layer must make one, or its attention ran
    #: past the paged cache (and its output is silently wrong)
    attention_calls: int = 0


class PagedAttentionBinding:
    """Ties one PaddleFormers attention module to its KV cache layer and the core attention."""

    def __init__(self, layer_index: int, attention: Attention, step: StepContext, generation):
        self.layer_index = layer_index
        self.attention = attention
        self.step = step
        self.generation = generation


#: bindings of the attention calls running now, for callers that hand the function a module of
#: their own instead of the attention module (PaddleFormers 0.4's MLA wrapper, :mod:`fd_paddleformers.mla`)
_active: list[PagedAttentionBinding] = []


@contextmanager
def calling_with(binding: PagedAttentionBinding):
    """Make ``binding`` the one an attention call without a bound module uses."""
    _active.append(binding)
    try:
        yield
    finally:
        _active.pop()


def paged_attention_forward(
    module,
    query: paddle.Tensor,
    key: paddle.Tensor,
    value: paddle.Tensor,
    attention_mask=None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
):
    """PaddleFormers attention-function signature -> ``(output [1, T, heads * d], None)``.

    ``attention_mask`` is ignored: causality and the per-sequence boundaries of the flattened
    batch come from the step's ``ForwardMeta`` (block tables, sequence and query lengths).
    ``scaling`` is ignored too: the core layer's scale was fixed from the module when it was
    bound (the module's ``scaling``; for MLA, :func:`fd_paddleformers.mla.kernel_scale`).
    """
    binding: PagedAttentionBinding | None = getattr(module, BINDING_ATTRIBUTE, None)
    if binding is None and _active:
        binding = _active[-1]
    if binding is None or binding.step.meta is None:
        raise RuntimeError(
            f"{type(module).__name__} ran with the fastdeploy paged attention outside a fastdeploy step; "
            "build and run it through fd_paddleformers.PaddleFormersForCausalLM"
        )
    step = binding.step
    q, k, v = binding.generation.attention_tokens(query, key, value)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens != step.meta.input_ids.shape[0]:
        raise RuntimeError(
            f"{type(module).__name__} handed the attention {num_tokens} tokens for a step of "
            f"{step.meta.input_ids.shape[0]}: the q/k/v layout is not the one {binding.generation.name} uses"
        )
    out = binding.attention(q, k, v, step.kv_caches[binding.layer_index], step.meta)
    step.attention_calls += 1
    return out.reshape([1, num_tokens, num_heads * head_dim]), None


_registered = False


def register_paged_attention() -> None:
    """Add :func:`paged_attention_forward` to PaddleFormers' attention table (idempotent)."""
    global _registered
    if _registered:
        return
    from paddleformers.nn.attention.interface import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, paged_attention_forward)
    _registered = True
