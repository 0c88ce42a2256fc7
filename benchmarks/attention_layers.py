"""What ``decode_attention.py`` and ``prompt_attention.py`` share: SmolLM2-135M's attention shape,
one KV cache per layer for its 30 layers (as the engine holds them), and the median time of
``fd_paged_attention`` over all of them. Not part of the test suite."""

from __future__ import annotations

import time

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 64, 30


def layer_caches(base, dtype: str) -> list:
    """``LAYERS`` (key, value) cache pairs of ``dtype`` holding the rows of ``base`` [blocks, BLOCK, KV_HEADS, HEAD_DIM]."""
    import paddle

    return [(paddle.to_tensor(base).astype(dtype), paddle.to_tensor(base).astype(dtype)) for _ in range(LAYERS)]


def median_over_layers(kernels, q, caches: list, meta, path: int, rounds: int, warm: int) -> float:
    """The median wall time in seconds of one ``fd_paged_attention`` call per layer's caches (bf16
    ``path``), over ``rounds`` rounds after ``warm`` untimed ones."""
    import numpy as np
    import paddle

    step = (paddle.to_tensor(meta.query_start_loc), paddle.to_tensor(meta.seq_lens), paddle.to_tensor(meta.block_tables))
    times = []
    for _ in range(rounds + warm):
        t0 = time.perf_counter()
        for k, v in caches:
            kernels.fd_paged_attention(q, k, v, *step, HEAD_DIM**-0.5, 0, path)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[warm:]))
