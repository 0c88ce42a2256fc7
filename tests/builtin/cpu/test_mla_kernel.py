"""``fd_mla_absorbed_attention`` (csrc/mla_attention.cc) against ``ReferenceOps.mla_paged_attention``.

The kernel computes the absorbed form: it must equal the reference's absorbed and expanded
forms (within float32 rounding) and write the same latent rows into the cache, over several
sequences of different lengths, contexts of ~2,000 tokens, and scrambled (non-contiguous)
block tables; ``CpuOps`` must send it only the absorbed form and leave prompt chunks under
``auto`` to the reference; a captured step must replay it over refreshed inputs.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

import fastdeploy_core.builtin.cpu.ops as cpu_ops
from fastdeploy_core.builtin.cpu.ops import CpuOps
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.testing.batches import BlockPool, blocks_for, build_meta

BS = 16


def _case(specs, heads=4, rank=48, nope=16, rope=8, v_dim=24, seed=0):
    """Random inputs for sequences ``specs`` = [(new tokens, context tokens)], blocks scrambled."""
    rng = np.random.default_rng(seed)
    nb = sum(blocks_for(n + ctx, BS) for n, ctx in specs) + 3
    pool = BlockPool(nb, seed=seed + 1)
    chunks = [(list(range(n)), ctx, pool.take(blocks_for(n + ctx, BS))) for n, ctx in specs]
    total = sum(n for n, _ in specs)
    arrays = {
        "cache": rng.standard_normal((nb, BS, 1, rank + rope)).astype(np.float32),
        "q": rng.standard_normal((total, heads, nope + rope)).astype(np.float32),
        "latent": rng.standard_normal((total, rank + rope)).astype(np.float32),
        "w_kv": (rng.standard_normal((heads, rank, nope + v_dim)) / np.sqrt(rank)).astype(np.float32),
    }
    return chunks, arrays, (nope + rope) ** -0.5


def _run(ops, chunks, arrays, scale, form):
    meta = build_meta(chunks, BS)
    cache = paddle.to_tensor(arrays["cache"])
    out = ops.mla_paged_attention(
        paddle.to_tensor(arrays["q"]),
        paddle.to_tensor(arrays["latent"]),
        cache,
        meta,
        paddle.to_tensor(arrays["w_kv"]),
        scale,
        form,
    )
    return out.numpy(), cache.numpy()


@pytest.fixture
def dispatched(cpu_kernels, monkeypatch):
    """The names of the custom ops ``CpuOps`` runs."""
    names = []
    run = cpu_ops._run

    def recording(name, *args):
        names.append(name)
        return run(name, *args)

    monkeypatch.setattr(cpu_ops, "_run", recording)
    return names


SHAPES = {
    # decode rows of different lengths, one shorter than a block, one exactly a block
    "decodes": [(1, 40), (1, 3), (1, 15), (1, 97)],
    # long contexts: the kernel walks ~2,000 keys per row through scrambled tables
    "long_decodes": [(1, 2000), (1, 1500), (1, 7)],
    # the absorbed form asked for on prompt chunks: rows with causal context inside the step
    "mixed_absorbed": [(5, 8), (1, 17), (12, 0), (1, 2047)],
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("heads,rank,nope,rope,v_dim", [(4, 48, 16, 8, 24), (3, 20, 12, 6, 10), (8, 128, 64, 32, 64)])
def test_kernel_equals_the_reference_forms(shape, heads, rank, nope, rope, v_dim, dispatched):
    chunks, arrays, scale = _case(SHAPES[shape], heads, rank, nope, rope, v_dim, seed=len(shape) + heads)
    want_expanded, want_cache = _run(ReferenceOps(), chunks, arrays, scale, "expanded")
    want_absorbed, _ = _run(ReferenceOps(), chunks, arrays, scale, "absorbed")
    form = "absorbed" if shape == "mixed_absorbed" else "auto"
    got, got_cache = _run(CpuOps(), chunks, arrays, scale, form)
    assert dispatched == ["fd_mla_absorbed_attention"]
    assert got.shape == (sum(n for n, _ in SHAPES[shape]), heads * v_dim)
    np.testing.assert_allclose(got, want_absorbed, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(got, want_expanded, rtol=1e-4, atol=2e-5)
    np.testing.assert_array_equal(got_cache, want_cache)


def test_prompt_chunks_under_auto_and_the_expanded_form_run_the_reference(dispatched):
    chunks, arrays, scale = _case([(5, 8), (1, 17)], seed=3)
    for form in ("auto", "expanded"):
        got, _ = _run(CpuOps(), chunks, arrays, scale, form)
        want, _ = _run(ReferenceOps(), chunks, arrays, scale, "expanded")
        np.testing.assert_array_equal(got, want)
    assert dispatched == []
    with pytest.raises(ValueError, match="form 'fast' is not one of"):
        _run(CpuOps(), chunks, arrays, scale, "fast")


def test_each_row_sees_only_its_own_sequence_and_its_causal_prefix(cpu_kernels):
    """A row whose only visible key is itself returns that key's value exactly (softmax of one);
    another sequence's rows, however large, change nothing."""
    chunks, arrays, scale = _case([(1, 0), (1, 30)], heads=2, rank=16, nope=8, rope=4, v_dim=8, seed=7)
    got, _ = _run(CpuOps(), chunks, arrays, scale, "auto")
    c, w_v = arrays["latent"][0, :16], arrays["w_kv"][:, :, 8:]
    np.testing.assert_allclose(got[0], np.concatenate([c @ w_v[0], c @ w_v[1]]), rtol=1e-5, atol=1e-6)
    arrays["cache"][chunks[1][2][0]] *= 1000.0  # the second sequence's first block
    again, _ = _run(CpuOps(), chunks, arrays, scale, "auto")
    np.testing.assert_array_equal(again[0], got[0])
    assert not np.allclose(again[1], got[1])


def test_bad_block_tables_and_slots_are_refused(cpu_kernels):
    chunks, arrays, scale = _case([(1, 20)], seed=9)
    nb = arrays["cache"].shape[0]
    table = chunks[0][2]
    # a context block outside the cache (the new token's slot, in the second block, is fine)
    with pytest.raises(Exception, match="block table entry 0 = .* outside the cache's"):
        _run(CpuOps(), [(chunks[0][0], chunks[0][1], [nb + 5, table[1]])], arrays, scale, "auto")
    # the new token's slot outside the cache
    with pytest.raises(Exception, match="slot .* outside the cache of"):
        _run(CpuOps(), [(chunks[0][0], chunks[0][1], [table[0], nb + 5])], arrays, scale, "auto")


def test_a_captured_step_replays_the_kernel_over_refreshed_inputs(cpu_kernels):
    chunks, arrays, scale = _case([(1, 40), (1, 300)], seed=11)
    ops = CpuOps()
    meta = build_meta(chunks, BS)
    q_host = arrays["q"].copy()
    q = paddle.utils.dlpack.from_dlpack(q_host)
    latent, w_kv = paddle.to_tensor(arrays["latent"]), paddle.to_tensor(arrays["w_kv"])
    cache = paddle.to_tensor(arrays["cache"])
    statics = [q, latent, cache, w_kv, meta.slot_mapping] + [
        meta.tensor(n) for n in ("query_start_loc", "seq_lens", "block_tables")
    ]
    forward = lambda: ops.mla_paged_attention(q, latent, cache, meta, w_kv, scale)  # noqa: E731
    plan = ops.capture_graph(forward, statics)
    assert plan.ok, plan.reason
    graph = ops.capture_graph(forward, statics, previous=plan)
    plan.release()
    assert graph.ok and graph.planned, graph.reason
    q_host[:] = np.random.default_rng(12).standard_normal(q_host.shape).astype(np.float32)
    replayed = graph.replay().numpy().copy()
    graph.release()
    want, _ = _run(ReferenceOps(), chunks, {**arrays, "q": q_host}, scale, "absorbed")
    np.testing.assert_allclose(replayed, want, rtol=1e-4, atol=2e-5)
