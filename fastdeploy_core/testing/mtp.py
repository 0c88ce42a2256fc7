"""What the multi-token-prediction tests of model plugins share (``method: mtp``).

- :func:`reference_mtp_logits`: transformers' ``MtpLayer`` (and the model's embedding, rotary
  embedding and LM head) over a row of tokens and hidden states, causally masked;
- :func:`paged_mtp_logits`: our ``forward_mtp`` over the same rows, computed in chunks over a
  paged MTP cache whose blocks are out of order;
- :func:`check_forward_mtp`: the two above on 8 random rows, compared;
- :func:`zero_block_outputs`: a checkpoint whose layers pass their input through.
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy_core.executor.forward_meta import ForwardMeta

#: Rows 0-4 in one prefill chunk, then 5, 6 and 7 one at a time.
CHUNKS = ((0, 5), (5, 1), (6, 1), (7, 1))


def reference_mtp_logits(hf_model, hf_mtp, tokens: np.ndarray, previous: np.ndarray) -> np.ndarray:
    """transformers' logits of ``hf_mtp`` for row ``t`` = (token ``tokens[t]``, hidden state
    ``previous[t]``), rotary positions ``t + 1`` (the tokens' own)."""
    import torch

    n = len(tokens)
    with torch.no_grad():
        embeds = hf_model.model.embed_tokens(torch.tensor(tokens)[None])
        position_ids = torch.arange(1, n + 1)[None]
        rope = hf_model.model.rotary_emb(embeds, position_ids=position_ids)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = hf_mtp(embeds, torch.tensor(previous)[None], rope, mask, position_ids, None)
        return hf_model.lm_head(out)[0].numpy()


def paged_mtp_logits(model, tokens: np.ndarray, previous: np.ndarray, chunks=CHUNKS, block_size: int = 4,
                     table=(3, 1)) -> np.ndarray:
    """``model.compute_logits(model.forward_mtp(...))`` over the rows of ``chunks`` in order, MTP
    layer 0, its cache in blocks ``table`` (row ``r`` at block ``table[r // block_size]``)."""
    caches = model.mtp_kv_cache_layout().allocate(6, block_size, lambda shape, dtype: paddle.zeros(shape, dtype))
    got = []
    for start, count in chunks:
        rows = np.arange(start, start + count)
        slots = np.array([table[r // block_size] * block_size + r % block_size for r in rows])
        meta = ForwardMeta(
            input_ids=paddle.to_tensor(tokens[rows].astype(np.int64)),
            positions=paddle.to_tensor(rows + 1),
            slot_mapping=paddle.to_tensor(slots.astype(np.int64)),
            query_start_loc=np.array([0, count], dtype=np.int64),
            seq_lens=np.array([start + count], dtype=np.int64),
            block_tables=np.array([list(table)], dtype=np.int64),
            block_size=block_size,
            logits_indices=paddle.to_tensor(np.array([count - 1], dtype=np.int64)),
        )
        with paddle.no_grad():
            out = model.forward_mtp(meta, paddle.to_tensor(previous[rows]), caches, 0)
            got.append(model.compute_logits(out).numpy())
    return np.concatenate(got)


def zero_block_outputs(tensors: dict) -> None:
    """Zero every attention output and feed-forward down projection of a checkpoint's tensors
    (HF names): each layer then passes its input through, so a hidden state is the final norm of
    its token's embedding (what the tests' "agreeing" MTP layers are built on)."""
    for key in list(tensors):
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[key] = tensors[key] * 0


def check_forward_mtp(model, hf_model, hf_mtp, rows: int = 8, seed: int = 0) -> None:
    """Our MTP layer 0 (paged, chunked) gives the reference's logits (within 1e-4) on ``rows``
    random tokens and hidden states; the reference's logits are not trivially small."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, hf_model.config.vocab_size, rows)
    previous = rng.standard_normal((rows, hf_model.config.hidden_size)).astype(np.float32)
    expected = reference_mtp_logits(hf_model, hf_mtp, tokens, previous)
    got = paged_mtp_logits(model, tokens, previous)
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0.1
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
