"""``--kv-cache-dtype bfloat16`` (alias ``bf16``) on a tiny random GQA Llama, against transformers.

The reference is the same transformers model with an attention function that computes the
formula of attention over a bfloat16 cache: the keys (after rotary) and values rounded to
bfloat16 (torch rounds to nearest even), as the cache stores them, and the scaled queries and
the softmax weights (exp(s - M), M the smallest multiple of ln 2 >= the row's largest score)
rounded before their products, which are summed in float32. The engine's
greedy tokens must equal that reference's. The engine's rotated keys come from another float32
computation than transformers' (fused multiply-adds, projection summation order), so a key can
round to the neighbouring bfloat16 now and then: logprobs are compared within a bound
(LOGPROB_TOL) that the float32 model's distance to the reference exceeds tenfold (the test's
premise: a flag that changed nothing fails it). Captured decode steps stay on and are checked
to be replayed. Also: the same cache memory holds twice the blocks, and the refusals.
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.engine.engine_core import EngineCore
from fastdeploy_core.errors import ConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.engine.test_engine_tiny import _save_tiny as save_tiny  # noqa: E402
from tests.engine.tiny_reference import PROMPTS, engine_core, greedy_reference, logprob_gaps, run_prompts  # noqa: E402

MAX_NEW = 16
#: The engine against the reference rounding K/V like it: measured 6e-6 on the kernels and 5e-4
#: on the reference ops (whose rotary rounds a key to the neighbouring bfloat16 somewhere); the
#: float32 model is 0.06 away, and must stay >= 10x farther than this bound.
LOGPROB_TOL = 3e-3
_ATTENTION = "fd_test_bf16_kv"


def _bf16_kv_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    from transformers.models.llama.modeling_llama import repeat_kv

    def rounded(t):
        return t.to(torch.bfloat16).to(torch.float32)

    keys = repeat_kv(rounded(key), module.num_key_value_groups)
    values = repeat_kv(rounded(value), module.num_key_value_groups)
    scores = torch.matmul(rounded(query * scaling), keys.transpose(2, 3))
    if attention_mask is not None:
        scores = scores + attention_mask
    # exp(s - M), M the smallest multiple of ln 2 >= the row's largest score (ReferenceOps's
    # formula: where the weights are rounded), normalised by the unrounded sum
    top = scores.amax(dim=-1, keepdim=True)
    lattice = torch.ceil(top * np.float32(1.4426950408889634)) * np.float32(0.6931471805599453)
    e = torch.exp(scores - lattice)
    out = torch.matmul(rounded(e), values) / e.sum(dim=-1, keepdim=True)
    return out.transpose(1, 2).contiguous(), e / e.sum(dim=-1, keepdim=True)


def _reference(model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    return greedy_reference(model, prompt, MAX_NEW)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, float32 reference per prompt, bf16-KV reference per prompt)."""
    path = str(tmp_path_factory.mktemp("bf16kv"))
    model = save_tiny(path, {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False})
    model.set_attn_implementation("eager")
    f32 = [_reference(model, p) for p in PROMPTS]
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    transformers.AttentionInterface.register(_ATTENTION, _bf16_kv_attention)
    AttentionMaskInterface.register(_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])  # eager's additive mask
    model.set_attn_implementation(_ATTENTION)
    bf16 = [_reference(model, p) for p in PROMPTS]
    return path, f32, bf16


_core = engine_core


def _run(core: EngineCore) -> dict:
    outs = run_prompts(core, MAX_NEW)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return outs


@pytest.mark.parametrize("spelling", ["bfloat16", "bf16"])
def test_bf16_kv_engine_matches_transformers_rounding_k_and_v(tiny, spelling):
    path, f32, bf16 = tiny
    core = _core(path, kv_cache_dtype=spelling)
    info = core.runner.describe()
    assert info["kv_cache_spec"]["dtype"] == "bfloat16"
    assert all(t.dtype == paddle.bfloat16 for layer in core.runner.kv_caches for t in layer)
    outs = _run(core)
    assert core.runner.graphs is not None and core.runner.graphs.captured_sizes, "no decode step was replayed"
    engine_gap, f32_gap = logprob_gaps(outs, bf16, f32)
    assert engine_gap < LOGPROB_TOL, engine_gap
    # The premise: rounding K/V moves logprobs far more than the engine's distance to the reference.
    assert f32_gap > 10 * LOGPROB_TOL, f32_gap
    # The cache really holds what was written (non-zero bfloat16 entries).
    assert float(core.runner.kv_caches[0][0].astype("float32").abs().max()) > 0


def test_chunked_prompts_and_prefix_hits_give_the_same_tokens(tiny):
    path, _, bf16 = tiny
    outs = _run(_core(path, kv_cache_dtype="bf16", max_num_batched_tokens=5, enforce_eager=True))
    for i in range(len(PROMPTS)):
        assert [t for o in outs[f"r{i}"] for t in o.new_token_ids] == bf16[i][0], f"prompt {i}"
    core = _core(path, kv_cache_dtype="bf16")
    _run(core)
    again = _run(core)  # every prompt's full blocks come from the prefix cache this time
    for i in range(len(PROMPTS)):
        assert [t for o in again[f"r{i}"] for t in o.new_token_ids] == bf16[i][0], f"prompt {i} (prefix hit)"
    assert again["r1"][0].num_cached_tokens >= 16


def test_the_same_cache_memory_holds_twice_the_blocks(tiny, caplog):
    path, _, _ = tiny
    f32_per_block = _core(path).runner.bytes_per_block
    budget = 50 * f32_per_block
    with caplog.at_level(logging.INFO, logger="fastdeploy_core.executor.model_runner"):
        f32 = _core(path, num_gpu_blocks_override=None, kv_cache_memory=budget)
        bf16 = _core(path, num_gpu_blocks_override=None, kv_cache_memory=budget, kv_cache_dtype="bfloat16")
    assert bf16.runner.bytes_per_block * 2 == f32_per_block
    assert (f32.runner.num_blocks, bf16.runner.num_blocks) == (50, 100)
    assert (f32.block_manager.num_blocks, bf16.block_manager.num_blocks) == (50, 100)
    assert bf16.runner.describe()["kv_cache_bytes"] == f32.runner.describe()["kv_cache_bytes"] == budget
    assert bf16.runner.describe()["kv_cache_spec"]["bytes_per_token_per_layer"] == 2 * 2 * 16 * 2  # K+V, 2 heads x 16
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert lines[0].startswith("KV cache: 50 blocks of 4 tokens (float32, ")
    assert lines[1].startswith("KV cache: 100 blocks of 4 tokens (bfloat16, ")
    k = bf16.runner.kv_caches[0][0]
    assert k.dtype == paddle.bfloat16 and list(k.shape) == [100, 4, 2, 16]


def test_refusals_name_kv_cache_dtype(tiny):
    path, _, _ = tiny
    refusal = "kv_cache_dtype: bfloat16 stores K/V as bfloat16, and quantization 'wint8'"
    with pytest.raises(ConfigError, match=refusal) as info:
        _core(path, kv_cache_dtype="bf16", quantization='{"quantization": "wint8", "kv_cache_quant_type": "int8"}')
    assert info.value.param == "kv_cache_dtype"
    with pytest.raises(ConfigError, match="kv_cache_dtype") as info:
        EngineArgs.create(model=path, kv_cache_dtype="fp8")
    assert info.value.param == "kv_cache_dtype"



def test_bf16_kv_goes_with_bf16_linears_and_weight_only_quantization(tiny, monkeypatch):
    """Methods without a KV cache of their own, and --dtype bfloat16, combine with it: the
    caches are bfloat16 and the kernels give the greedy tokens the reference ops give for the
    same settings (transformers has no wint8 to compare with; on this tiny random model wint8
    plus bfloat16 attention moves a prompt's second token off the float32 one, in the
    reference ops alike)."""
    from fastdeploy_core.builtin.cpu.ops import CpuOps

    path, _, _ = tiny
    for settings in ({"quantization": "wint8"}, {"dtype": "bfloat16"}):
        core = _core(path, kv_cache_dtype="bf16", **settings)
        assert core.runner.describe()["kv_cache_spec"]["dtype"] == "bfloat16"
        outs = _run(core)
        with monkeypatch.context() as patch:
            patch.setattr(CpuOps, "_ready", lambda self: False)
            patch.setattr(CpuOps, "_have_kernels", False)
            ref = _run(_core(path, kv_cache_dtype="bf16", enforce_eager=True, **settings))
        for i in range(len(PROMPTS)):
            got = [t for o in outs[f"r{i}"] for t in o.new_token_ids]
            assert got == [t for o in ref[f"r{i}"] for t in o.new_token_ids], (settings, i)


def test_the_reference_ops_give_the_same_tokens(tiny, monkeypatch):
    """Without the C++ kernels (the plain-Paddle ReferenceOps write and widen the bfloat16 cache)
    the engine gives the same greedy tokens as transformers rounding K/V."""
    from fastdeploy_core.builtin.cpu.ops import CpuOps

    path, _, bf16 = tiny
    monkeypatch.setattr(CpuOps, "_ready", lambda self: False)
    monkeypatch.setattr(CpuOps, "_have_kernels", False)
    core = _core(path, kv_cache_dtype="bf16")
    assert not core.runner.ops.ragged_attention  # the reference's padded attention, not the kernels
    outs = _run(core)
    for i in range(len(PROMPTS)):
        got = [t for o in outs[f"r{i}"] for t in o.new_token_ids]
        assert got == bf16[i][0], f"prompt {i}"
        rows = bf16[i][1]
        lps = [lp for o in outs[f"r{i}"] for lp in o.new_logprobs]
        assert max(abs(lp[got[k]] - rows[k][got[k]]) for k, lp in enumerate(lps)) < LOGPROB_TOL
