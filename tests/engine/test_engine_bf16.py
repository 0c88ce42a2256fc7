"""``--dtype bfloat16`` on tiny random Llama checkpoints, against transformers emulating it.

The reference is the same transformers model with every linear layer (the LM head included)
made bfloat16 the way the engine defines it: weights rounded to bfloat16, each linear's input
rounded to bfloat16 before the product, sums and everything else float32. The engine's greedy
tokens must equal the reference's, its logprobs must sit within float32 summation noise of the
reference's, and the test checks its own premise: the float32 model's logprobs are much farther
away (a bfloat16 flag that changed nothing fails). Captured decode
steps stay on (and are checked to be in use), so replays are part of what is compared.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import pytest

from fastdeploy_core.builtin.cpu.kernels import amx_state
from fastdeploy_core.devices.host_cpu import has_avx512f
from fastdeploy_core.engine.engine_core import EngineCore
from fastdeploy_core.errors import ConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.engine.test_engine_tiny import _save_tiny as save_tiny  # noqa: E402
from tests.engine.tiny_reference import PROMPTS, engine_core, greedy_reference, logprob_gaps, run_prompts  # noqa: E402

MAX_NEW = 12
#: The engine against the emulating reference: float32 summation order only (measured ~1e-6;
#: the float32 engine is 0.08-0.12 away from the emulation, and fails this test).
LOGPROB_TOL = 1e-4


def _save_tiny(path: str, tied: bool):
    """test_engine_tiny's tiny GQA Llama (4 heads over 2 KV heads), tied or not."""
    return save_tiny(path, {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": tied})


def _emulate_bf16_linears(model):
    """Every nn.Linear: weight rounded to bfloat16 (torch rounds to nearest even), input rounded
    to bfloat16 by a pre-hook, product and sums float32. A tied head gets its own rounded copy
    (the embedding lookups stay float32, as in the engine)."""
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.to(torch.bfloat16).to(torch.float32)
            module.register_forward_pre_hook(lambda _, args: (args[0].to(torch.bfloat16).to(torch.float32),))
    return model


def _reference(model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    return greedy_reference(model, prompt, MAX_NEW)


@pytest.fixture(scope="module", params=["untied", "tied"])
def tiny(request, tmp_path_factory):
    """(path, {prompt index: (float32 tokens, float32 rows)}, {...bf16 emulation...})."""
    path = str(tmp_path_factory.mktemp(request.param))
    model = _save_tiny(path, request.param == "tied")
    f32 = [_reference(model, p) for p in PROMPTS]
    bf16 = [_reference(_emulate_bf16_linears(model), p) for p in PROMPTS]
    return path, f32, bf16


_core = engine_core


def _run(core: EngineCore) -> dict:
    return run_prompts(core, MAX_NEW)


def test_bf16_engine_matches_transformers_emulating_bf16_linears(tiny):
    path, f32, bf16 = tiny
    core = _core(path, dtype="bfloat16")
    info = core.runner.describe()
    assert info["linear_weights"] == "bfloat16"
    outs = _run(core)
    assert info["graph_capture"].startswith("decode batch sizes"), info["graph_capture"]
    assert core.runner.graphs.captured_sizes, "no decode step was captured and replayed"
    engine_gap, f32_gap = logprob_gaps(outs, bf16, f32)
    # The premise: bfloat16 moves logprobs far more than the engine's distance to the emulation.
    assert f32_gap > 10 * LOGPROB_TOL, f32_gap
    if has_avx512f() and amx_state("fd_bf16_amx_state") != 1:
        assert engine_gap < LOGPROB_TOL
    else:
        # Without AVX-512 the attention kernel sums its lanes in another order, and on a CPU
        # whose linears take AMX tiles each tdpbf16ps sums 16 k pairs in two chains before adding
        # them (neither is torch's order); a float32 difference that flips the bfloat16 rounding
        # of a linear's input moves it by 2^-9, and that shows in the logprobs (measured 6.9e-3 on
        # an AVX2 EPYC, 2.4e-3 / 6.3e-4 untied / tied on a Xeon with AMX; the float32 model
        # 7.8e-2 away): still the emulation's tokens, and 10x closer to it than float32.
        assert engine_gap < f32_gap / 10, (engine_gap, f32_gap)


def test_bf16_eager_equals_captured(tiny):
    """Replayed decode steps give the eager steps' tokens and logprobs bit for bit."""
    path, _, _ = tiny
    captured = _run(_core(path, dtype="bfloat16"))
    eager = _run(_core(path, dtype="bfloat16", enforce_eager=True))
    for rid in captured:
        assert [o.new_token_ids for o in captured[rid]] == [o.new_token_ids for o in eager[rid]]
        assert [o.new_logprobs for o in captured[rid]] == [o.new_logprobs for o in eager[rid]]


def test_bf16_norms_hand_the_linears_rounded_rows_with_the_same_results(tiny, cpu_kernel_calls, monkeypatch):
    """With bfloat16 linears the decoder's norms write their rows rounded to bfloat16 (the cpu
    table's ``rms_norm_bf16_rows``), which the QKV and gate/up projections read as they are: the
    same tokens and logprobs, bit for bit, as float32 rows those projections round themselves."""
    from fastdeploy_core.builtin.cpu.ops import CpuOps

    path, _, _ = tiny
    rounded_in_norm = _run(_core(path, dtype="bfloat16", enforce_eager=True))
    norms = [name for name in cpu_kernel_calls if "rms_norm" in name]
    assert {"fd_rms_norm_bf16", "fd_add_rms_norm_bf16"} <= set(norms), sorted(set(norms))
    assert "fd_add_rms_norm" in norms  # the final norm, before the head, stays float32
    monkeypatch.setattr(CpuOps, "rms_norm_bf16_rows", None)  # a table without it: float32 rows
    cpu_kernel_calls.clear()
    rounded_in_linear = _run(_core(path, dtype="bfloat16", enforce_eager=True))
    assert not [name for name in cpu_kernel_calls if name.endswith("rms_norm_bf16")]
    for rid in rounded_in_norm:
        assert [o.new_token_ids for o in rounded_in_norm[rid]] == [o.new_token_ids for o in rounded_in_linear[rid]]
        assert [o.new_logprobs for o in rounded_in_norm[rid]] == [o.new_logprobs for o in rounded_in_linear[rid]]


def test_bf16_with_a_quantization_method_is_refused(tiny):
    path, _, _ = tiny
    for method in ("wint4", "wint8"):
        with pytest.raises(ConfigError, match=rf"dtype: bfloat16 stores the linear layers in bfloat16, and quantization '{method}'") as info:
            _core(path, dtype="bfloat16", quantization=method)
        assert info.value.param == "dtype"


def test_bf16_with_an_int8_kv_cache_runs(tiny):
    path, _, _ = tiny
    outs = _run(_core(path, dtype="bfloat16", kv_cache_dtype="int8"))
    assert len(outs) == len(PROMPTS) and all(len(o) for o in outs.values())
