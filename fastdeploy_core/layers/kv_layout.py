"""What a model's paged KV cache holds per token: the layout a model declares, the runner allocates.

Most models cache a key and a value per KV head (two tensors per layer, each
``[num_blocks, block_size, kv_heads, head_dim]``). Multi-head latent attention (DeepSeek-V2/V3)
caches one compressed latent vector plus one shared rotary key per token (one tensor per layer,
``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``), which its attention op
expands or absorbs. A model states which through ``kv_cache_layout()``; the runner sizes the
blocks (bytes per token) and allocates the tensors from it without knowing the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

#: Bytes of one cache element: float32 (the only matmul dtype of Paddle's CPU build).
FLOAT32_BYTES = 4
#: Bytes of one cache element per storage dtype (``--kv-cache-dtype bfloat16``: K/V rounded to
#: bfloat16 when written, widened to float32 when read).
CACHE_DTYPE_BYTES = {"float32": FLOAT32_BYTES, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """The paged cache of one model.

    Attributes:
        num_layers: layers with a cache (one cache tuple each, in layer order).
        token_shapes: per cache tensor of a layer, the shape of one token's entry; a tensor is
            ``[num_blocks, block_size, *shape]``.
        kind: ``"key_value"`` (K and V per KV head, read by ``paged_attention``) or ``"latent"``
            (one latent + rotary key row, read by ``mla_paged_attention``).
        parts: the lengths of the differently scaled parts of a token's vector (the latent and
            the rotary key; an int8 cache gives each part its own scale); ``()``: one part.
    """

    num_layers: int
    token_shapes: tuple[tuple[int, ...], ...]
    kind: str = "key_value"
    parts: tuple[int, ...] = ()

    @classmethod
    def key_value(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> KVCacheLayout:
        """A key and a value of ``head_dim`` per KV head and token."""
        shape = (int(num_kv_heads), int(head_dim))
        return cls(int(num_layers), (shape, shape), "key_value")

    @classmethod
    def latent(cls, num_layers: int, kv_lora_rank: int, rope_head_dim: int) -> KVCacheLayout:
        """One row of ``kv_lora_rank + rope_head_dim`` per token (one "head"): the latent then the rotary key."""
        return cls(int(num_layers), ((1, int(kv_lora_rank) + int(rope_head_dim)),), "latent",
                   (int(kv_lora_rank), int(rope_head_dim)))

    def elements_per_token(self) -> int:
        """Cache elements one token takes in one layer (all of the layer's tensors)."""
        return sum(prod(shape) for shape in self.token_shapes)

    def bytes_per_token(self, dtype_bytes: int = FLOAT32_BYTES) -> int:
        """Bytes one token takes in one layer."""
        return self.elements_per_token() * dtype_bytes

    def allocate(self, num_blocks: int, block_size: int, zeros, dtype: str = "float32") -> list[tuple]:
        """Per layer, a tuple of ``dtype`` (float32 or bfloat16) cache tensors made by ``zeros(shape, dtype)``."""
        return [
            tuple(zeros((int(num_blocks), int(block_size), *shape), dtype) for shape in self.token_shapes)
            for _ in range(self.num_layers)
        ]


def kv_cache_layout(model) -> KVCacheLayout:
    """The layout ``model`` declares (``kv_cache_layout()``), else the key/value layout of its
    ``kv_cache_spec() -> (num_layers, num_kv_heads, head_dim)``."""
    declared = getattr(model, "kv_cache_layout", None)
    if declared is not None:
        return declared()
    return KVCacheLayout.key_value(*model.kv_cache_spec())
