"""Native Llama-family model (Llama 2/3/3.1, SmolLM, Mistral-style) built from core layers.

Covers GQA, tied or untied embeddings, rope scaling (linear, llama3), an explicit ``head_dim``
and Mistral's sliding window. The decoder itself is the core's generic one
(:mod:`fastdeploy_core.layers.decoder`): Q/K/V and gate/up are fused into one matmul each, and
checkpoint tensors keep their HF names.
"""

from __future__ import annotations

from fastdeploy_core.layers.decoder import DecoderDims, DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama causal LM over a paged KV cache (see :class:`DecoderForCausalLM` for the interface)."""

    family = "Llama"

    def make_dims(self, hf_config: dict) -> DecoderDims:
        dims = DecoderDims(hf_config, self.family)
        # Mistral v0.1 style: each token attends to the last `sliding_window` positions only.
        if hf_config.get("use_sliding_window", True) is not False:
            dims.set_sliding_window(hf_config.get("sliding_window"))
        return dims
