"""The runner's greedy fast path: plain greedy steps ask the model for tokens, not logits.

When every sampled request of a step is plain greedy (``Sampler.all_plain_greedy``) the runner
calls ``model.compute_greedy_tokens`` (the cpu device: ``fd_greedy_head``, an int8 screen plus
the float32 tiles that can hold the argmax); otherwise it computes the logits and samples. The
tokens must be the same either way: here on a tiny random Llama (both paths, batched, and
mixed with requests that need the logits) and on the real default model.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest

from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.builtin.cpu.kernels import has_int8_dot, load_kernels
from tests.engine.test_engine_tiny import PROMPTS, _save_tiny, greedy, make_core, run, tokens

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("greedy_head"))
    _save_tiny(path, {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True})
    return path


class Calls:
    """Counts the model's greedy-token and logits calls (instance attributes shadow the methods)."""

    def __init__(self, model, monkeypatch, disable_greedy: bool = False):
        self.greedy = self.logits = 0
        greedy_fn, logits_fn = model.compute_greedy_tokens, model.compute_logits

        def counted_greedy(hidden):
            self.greedy += 1
            return greedy_fn(hidden)

        def counted_logits(hidden):
            self.logits += 1
            return logits_fn(hidden)

        monkeypatch.setattr(model, "compute_greedy_tokens", None if disable_greedy else counted_greedy, raising=False)
        monkeypatch.setattr(model, "compute_logits", counted_logits, raising=False)


def _all(core, params_for) -> dict:
    outs = run(core, [(f"r{i}", p, params_for(i)) for i, p in enumerate(PROMPTS)])
    return {i: tokens(outs, f"r{i}") for i in range(len(PROMPTS))}


def test_plain_greedy_batches_take_the_greedy_head_with_the_same_tokens(tiny_path, monkeypatch):
    core = make_core(tiny_path)
    head = core.runner.model.lm_head
    if load_kernels() is not None and has_int8_dot():
        assert head.greedy_state is not None, "the cpu ops must prepare the greedy head's screen after loading"
    fast = Calls(core.runner.model, monkeypatch)
    got = _all(core, lambda i: greedy())
    assert fast.greedy > 0 and fast.logits == 0
    slow = Calls(core.runner.model, monkeypatch, disable_greedy=True)
    want = _all(core, lambda i: greedy())
    assert slow.logits > 0
    assert got == want


@pytest.mark.parametrize(
    "extra",
    [{"logprobs": 2}, {"repetition_penalty": 1.3}, {"presence_penalty": 0.5}, {"min_tokens": 40}],
    ids=["logprobs", "repetition_penalty", "presence_penalty", "min_tokens"],
)
def test_a_request_needing_the_logits_keeps_the_step_on_the_sampler(tiny_path, monkeypatch, extra):
    """One request with logprobs, a penalty or a min_tokens mask in every step: no step takes the
    greedy head, and the plain greedy requests still get their greedy tokens."""
    core = make_core(tiny_path)
    plain = _all(core, lambda i: greedy())
    calls = Calls(core.runner.model, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **extra)
    outs = run(
        core, [("needs_logits", PROMPTS[0] * 3, params)] + [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)]
    )
    assert calls.greedy == 0 and calls.logits > 0
    assert {i: tokens(outs, f"r{i}") for i in range(len(PROMPTS))} == plain


@pytest.mark.slow
def test_default_model_greedy_head_matches_the_logits_path(monkeypatch):
    """SmolLM2 (the default model): a batch of chat prompts, 24 tokens each, fast and full path."""
    from fastdeploy_core import LLM

    llm = LLM(max_model_len=512, num_gpu_blocks_override=48, max_num_seqs=8)
    model = llm.engine.core.runner.model
    if has_int8_dot():
        assert model.lm_head.greedy_state is not None
    prompts = ["What is the capital of France?", "Name three colours.", "Count to five.", "Why is the sky blue?"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fast = Calls(model, monkeypatch)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert fast.greedy > 0 and fast.logits == 0
    Calls(model, monkeypatch, disable_greedy=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want


def test_a_quantized_head_keeps_logits_and_argmax(tiny_path, monkeypatch):
    """wint8 stores the head as int8: no greedy state; greedy_tokens is argmax_rows of its logits."""
    from fastdeploy_core.layers.linear import UnquantizedLinearMethod

    core = make_core(tiny_path, quantization="wint8")
    head = core.runner.model.lm_head
    assert not isinstance(head.quant_method, UnquantizedLinearMethod) and head.greedy_state is None
    fast = Calls(core.runner.model, monkeypatch)
    got = _all(core, lambda i: greedy())
    assert fast.greedy > 0 and fast.logits == 0
    Calls(core.runner.model, monkeypatch, disable_greedy=True)
    assert _all(core, lambda i: greedy()) == got
