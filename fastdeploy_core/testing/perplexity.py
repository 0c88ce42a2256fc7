"""Perplexity of a fixed token sequence under a model, run through the paged path.

For tests that hold a quantized model near its float32 self: load the same checkpoint with and
without a quantizer (:func:`load_model`) and compare :func:`sequence_perplexity` of one
sequence (typically a prompt plus transformers' greedy continuation of the same random
checkpoint, so the float32 perplexity is low and quantization error shows). The sequence runs
as one prefill over a paged KV cache (the layout the model declares) on the current ops, and
every position's logits score the next token.
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy_core.loader import load_model_weights, resolve_model_source
from fastdeploy_core.plugins import load_plugins
from fastdeploy_core.quantization.factory import build_quantizer
from fastdeploy_core.testing.batches import build_meta
from fastdeploy_core.testing.paged_harness import PagedHarness


def load_model(model_cls, path: str, quantization: str | None = None, settings: dict | None = None):
    """``model_cls`` built from the checkpoint at ``path`` and loaded, in eval mode, under the
    quantizer ``quantization`` with ``settings`` (float32 when ``quantization`` is ``None``)."""
    source = resolve_model_source(path)
    quant_config = build_quantizer(quantization, settings or {}, load_plugins()) if quantization else None
    model = model_cls(source.hf_config, quant_config=quant_config)
    model.eval()
    load_model_weights(model, source)
    return model


def sequence_logits(model, sequence: list[int], block_size: int = 16) -> np.ndarray:
    """Float32 logits ``[len(sequence), vocab]``: row ``i`` predicts token ``i + 1``."""
    harness = PagedHarness(model, num_blocks=-(-len(sequence) // block_size) + 1, block_size=block_size)
    table = list(range(1, harness.kv_caches[0][0].shape[0]))  # block 0 left unused
    meta = build_meta([(sequence, 0, table)], block_size)
    with paddle.no_grad():
        return model.compute_logits(model(meta, harness.kv_caches)).numpy()


def sequence_perplexity(model, sequence: list[int], block_size: int = 16) -> float:
    """``exp`` of the mean negative log-likelihood of ``sequence[1:]`` given what precedes each token."""
    logits = sequence_logits(model, sequence, block_size)[:-1].astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return float(np.exp(-log_probs[np.arange(len(sequence) - 1), sequence[1:]].mean()))


def greedy_sequence(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    """``prompt`` followed by the transformers model's ``new_tokens`` greedy tokens (eos ignored):
    a sequence the model is confident about, to score with :func:`sequence_perplexity`."""
    import torch  # a test-only dependency, as in model_parity

    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0].tolist()
