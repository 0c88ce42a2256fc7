"""Speculative decoding with DeepSeek-V3's multi-token-prediction layer (``method: mtp``).

A tiny random DeepSeek-V3 with one MTP layer (transformers' ``MtpLayer``, float32): our
``forward_mtp`` gives transformers' logits over a paged cache; through the engine ``mtp`` leaves
every token as it is without speculation (batched, prefix-cache hits, chunked prefill,
preemption, seeded sampling), frees every block, and in a model built so that the MTP layer must
agree with the target every draft is accepted; the settings it cannot honour are refused.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest
import torch
from fd_deepseek.deepseek import DeepseekV3ForCausalLM
from safetensors.torch import load_file, save_file
from test_deepseek_tiny_configs import PROMPTS, _hf_model, _load, add_mtp_layer

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.engine.engine_core import EngineCore
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.errors import ConfigError
from fastdeploy_core.testing.engine_run import run_to_end
from fastdeploy_core.testing.mtp import check_forward_mtp, zero_block_outputs

pytestmark = pytest.mark.usefixtures("restore_ops")

NAME = "q_lora_yarn_interleaved"  # YaRN and interleaved rotary pairs: the MTP layer's rope must match too
MTP = {"method": "mtp", "num_speculative_tokens": 3}
MORE_PROMPTS = [*PROMPTS, [1, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57], [1, 12, 12, 12, 12, 30]]


def _save_with_mtp(tmp_path_factory, name: str, tag: str, count: int = 1):
    """transformers' DeepSeek-V3 ``name`` plus ``count`` random ``MtpLayer`` s saved as
    ``model.layers.{N + k}`` in DeepSeek's names: (path, the HF model, the first HF MTP layer)."""
    hf_model = _hf_model(name)
    path = str(tmp_path_factory.mktemp(f"mtp_{tag}"))
    hf_model.save_pretrained(path, safe_serialization=True)
    _, mtp = add_mtp_layer(path, hf_model, count)
    return path, hf_model, mtp


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory):
    return _save_with_mtp(tmp_path_factory, NAME, "random")


def _make_agreeing(path: str, hf_model, layers: list[int]) -> None:
    """Zero every attention output and feed-forward projection, and make MTP layers ``layers``
    (0-based) pass their normalised embedding half through (see :func:`agreeing`)."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    hidden = hf_model.config.hidden_size
    zero_block_outputs(tensors)
    for k in layers:
        first = hf_model.config.num_hidden_layers + k
        tensors[f"model.layers.{first}.eh_proj.weight"] = torch.cat(
            [torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1
        ).contiguous()
        tensors[f"model.layers.{first}.enorm.weight"] = torch.ones(hidden)
        tensors[f"model.layers.{first}.shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    """A checkpoint whose MTP layer must guess what the target computes next: every attention
    output and feed-forward projection is zero, so the target's hidden state at a position is the
    final norm of its token's embedding; the MTP layer's ``eh_proj`` passes the (normalised)
    embedding half through and drops the hidden half, and its ``shared_head.norm`` is the final
    norm, so its output for the token at ``p + 1`` is the target's hidden state at ``p + 1``.
    (Had the layer read ``[hidden, embedding]`` or the token at ``p``, it would guess wrong.)"""
    path, hf_model, _ = _save_with_mtp(tmp_path_factory, NAME, "agreeing")
    _make_agreeing(path, hf_model, [0])
    return path


# ---- the layer itself ------------------------------------------------------------------------
def test_forward_mtp_matches_transformers_mtp_layer(with_mtp):
    """Rows 0-4 in one prefill chunk, then 5-7 one at a time over the paged cache (block size 4,
    blocks out of order); rotary positions are the tokens' own (cache row + 1)."""
    path, hf_model, hf_mtp = with_mtp
    set_current_ops(ReferenceOps())
    model = _load(path)
    assert isinstance(model, DeepseekV3ForCausalLM) and model.num_mtp_layers == 1
    check_forward_mtp(model, hf_model, hf_mtp)


# ---- through the engine ----------------------------------------------------------------------
def _core(path: str, spec: dict | None, **kw) -> EngineCore:
    settings = {"model": path, "max_model_len": 64, "block_size": 4, "num_gpu_blocks_override": 96, **kw}
    if spec:
        settings["speculative_config"] = spec
    return EngineCore(EngineArgs.create(**settings))


def _run(core: EngineCore, requests, abort_after: dict | None = None) -> dict:
    return run_to_end(core, requests, abort_after)


def _greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _batch() -> list:
    return [(f"g{i}", p, _greedy()) for i, p in enumerate(MORE_PROMPTS)]


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"max_num_batched_tokens": 5},  # chunked prompts; the MTP layer catches up in chunks as well
        {"num_gpu_blocks_override": 20, "max_num_seqs": 5},  # too few blocks: requests are preempted
        {"enable_prefix_caching": False},
        {"kv_cache_dtype": "int8"},  # the MTP cache is quantized like the target's
    ],
    ids=["plain", "chunked", "preempted", "no_prefix_cache", "int8_cache"],
)
def test_mtp_tokens_equal_no_speculation(with_mtp, settings):
    path = with_mtp[0]
    off = _run(_core(path, None, **settings), _batch())
    core = _core(path, MTP, **settings)
    on = _run(core, _batch())
    assert on == off
    stats = core.get_stats()
    assert stats["spec_decode_method"] == "mtp"
    assert stats["spec_decode_num_draft_tokens_total"] > 0, stats
    if "num_gpu_blocks_override" in settings:
        assert core.scheduler.num_preemptions > 0
    if "kv_cache_dtype" in settings:
        from fastdeploy_core.quantization.kv_cache import QuantizedKVCache

        assert isinstance(core.runner.mtp_kv_caches()[0][0], QuantizedKVCache)


def test_mtp_tokens_equal_on_prefix_cache_hits(with_mtp):
    """Second requests start past their cached prefix: their MTP rows start there too."""
    path = with_mtp[0]
    first = [(f"a{i}", p, _greedy(12)) for i, p in enumerate(MORE_PROMPTS)]
    off_core, core = _core(path, None), _core(path, MTP)
    off_first, on_first = _run(off_core, first), _run(core, first)
    assert on_first == off_first
    again = [(f"b{i}", p + off_first[f"a{i}"][:6], _greedy(16)) for i, p in enumerate(MORE_PROMPTS)]
    hits = core.block_manager.prefix_hit_tokens
    assert _run(core, again) == _run(off_core, again)
    assert core.block_manager.prefix_hit_tokens > hits


def test_seeded_sampling_keeps_its_tokens(with_mtp):
    path = with_mtp[0]
    reqs = [
        (f"s{i}", p, SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=20, ignore_eos=True))
        for i, p in enumerate(MORE_PROMPTS)
    ]
    core = _core(path, MTP)
    assert _run(core, reqs) == _run(_core(path, None), reqs)
    assert core.get_stats()["spec_decode_num_draft_tokens_total"] > 0


def test_blocks_and_state_are_freed_after_aborts(with_mtp):
    path = with_mtp[0]
    core = _core(path, MTP)
    outs = _run(core, _batch(), abort_after={"g0": 3, "g3": 6})
    assert len(outs["g1"]) == 24 and len(outs.get("g0", [])) < 24


def test_an_agreeing_mtp_layer_has_every_draft_accepted(agreeing):
    off = _run(_core(agreeing, None), _batch())
    core = _core(agreeing, MTP)
    assert _run(core, _batch()) == off
    stats = core.get_stats()
    proposed, accepted = stats["spec_decode_num_draft_tokens_total"], stats["spec_decode_num_accepted_tokens_total"]
    assert proposed > 0 and accepted == proposed, stats
    assert stats["spec_decode_draft_acceptance_rate"] == 1.0
    rows = core.scheduler.num_speculative_rows
    assert stats["spec_decode_mean_accepted_length"] == pytest.approx((accepted + rows) / rows)
    assert stats["spec_decode_mean_accepted_length"] > 2.5  # up to 3 drafts + the target's token per step
    from fastdeploy_core.entrypoints.openai.metrics import ServerMetrics

    text = ServerMetrics(core.get_stats).render().decode()
    assert f'fastdeploy:spec_decode_num_accepted_tokens_total{{method="mtp"}} {float(accepted)}' in text


def test_acceptance_counters_are_consistent_with_a_random_layer(with_mtp):
    core = _core(with_mtp[0], MTP)
    _run(core, _batch())
    stats = core.get_stats()
    proposed, accepted = stats["spec_decode_num_draft_tokens_total"], stats["spec_decode_num_accepted_tokens_total"]
    assert 0 <= accepted <= proposed and proposed > 0
    rows = core.scheduler.num_speculative_rows
    assert stats["spec_decode_num_emitted_tokens_total"] == accepted + rows
    assert stats["spec_decode_mean_accepted_length"] == pytest.approx((accepted + rows) / rows)


# ---- refusals ----------------------------------------------------------------------------------
def test_a_model_without_mtp_layers_is_refused(tmp_path_factory):
    hf_model = _hf_model(NAME)
    path = str(tmp_path_factory.mktemp("no_mtp"))
    hf_model.save_pretrained(path, safe_serialization=True)
    with pytest.raises(ConfigError, match="needs multi-token-prediction layers") as err:
        _core(path, MTP)
    assert err.value.param == "speculative_config.method"


@pytest.mark.parametrize(
    "spec, param",
    [
        ({**MTP, "num_model_steps": 2}, "speculative_config.num_model_steps"),
        ({**MTP, "num_model_steps": 0}, "speculative_config.num_model_steps"),
        ({**MTP, "num_model_steps": 9}, "speculative_config.num_model_steps"),
        ({**MTP, "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({**MTP, "max_ngram_size": 3}, "speculative_config.max_ngram_size"),
        ({"method": "ngram", "num_model_steps": 1}, "speculative_config.num_model_steps"),
    ],
    ids=["steps_mismatch", "steps_zero", "steps_nine", "tokens_zero", "ngram_key", "steps_for_ngram"],
)
def test_settings_mtp_cannot_honour_are_refused(with_mtp, spec, param):
    with pytest.raises(ConfigError) as err:
        _core(with_mtp[0], spec)
    assert err.value.param == param, err.value


def test_tensor_parallelism_is_refused_before_loading(with_mtp):
    with pytest.raises(ConfigError, match="under tensor parallelism") as err:
        _core(with_mtp[0], MTP, tensor_parallel_size=2)
    assert err.value.param == "tensor_parallel_size"


def test_matching_num_model_steps_is_accepted(with_mtp):
    core = _core(with_mtp[0], {**MTP, "num_model_steps": 3})
    assert core.config_info()["speculative_config"]["num_model_steps"] == 3
    assert _run(core, _batch()[:2]) == _run(_core(with_mtp[0], None), _batch()[:2])


# ---- several MTP layers ----------------------------------------------------------------------
# DeepSeek-V3's MTP modules are sequential: module k reads module k - 1's output at a position and
# the token k + 1 after it. With D layers the proposer guesses the tokens at L .. L + D - 1 from
# row L - 2 (layer j from layer j - 1's output and the j-th guess), then chains the last layer.
MTP3 = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    return _save_with_mtp(tmp_path_factory, NAME, "two_random", count=2)[0]


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 5}], ids=["plain", "chunked"])
def test_two_mtp_layers_keep_the_tokens(two_layers, settings):
    off = _run(_core(two_layers, None, **settings), _batch())
    core = _core(two_layers, MTP3, **settings)
    assert _run(core, _batch()) == off
    assert core.proposer.describe()["mtp"] == {"num_mtp_layers": 2, "layers_used": 2}
    assert core.get_stats()["spec_decode_num_draft_tokens_total"] > 0
    assert core.runner.mtp_layout.num_layers == 2


@pytest.mark.parametrize(
    "agreeing_layers, all_accepted", [([0, 1], True), ([0], False)], ids=["both_agree", "second_random"]
)
def test_the_second_layer_guesses_the_second_token(tmp_path_factory, agreeing_layers, all_accepted):
    """Both layers built to agree with the target: every draft is accepted, so the second layer
    read the first guess and the first layer's output (had it read the known token or the
    target's hidden state, its guesses would repeat the first). With the second layer random,
    drafts are rejected: the second guess really comes from the second layer."""
    path, hf_model, _ = _save_with_mtp(tmp_path_factory, NAME, "two_" + "_".join(map(str, agreeing_layers)), count=2)
    _make_agreeing(path, hf_model, agreeing_layers)
    off = _run(_core(path, None), _batch())
    core = _core(path, MTP3)
    assert _run(core, _batch()) == off
    stats = core.get_stats()
    proposed, accepted = stats["spec_decode_num_draft_tokens_total"], stats["spec_decode_num_accepted_tokens_total"]
    assert proposed > 0
    if all_accepted:
        assert accepted == proposed, stats
        assert stats["spec_decode_mean_accepted_length"] > 2.5
    else:
        assert accepted < 0.8 * proposed, stats
