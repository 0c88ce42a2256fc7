"""SamplingParams defaults, wire format and the plain-data contract of the core's messages."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from fastdeploy_core.engine.outputs import (
    CompletionOutput,
    CompletionOutputs,
    EngineCoreOutput,
    EngineCoreRequest,
    choice_request_id,
)
from fastdeploy_core.engine.request import Request
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.errors import InvalidRequestError
from fastdeploy_core.executor.sampler import Sampler


def test_generation_config_fills_only_unset_fields():
    gen = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 77}
    filled = SamplingParams(top_p=0.5).with_generation_config_defaults(gen)
    assert (filled.temperature, filled.top_p, filled.top_k, filled.repetition_penalty, filled.max_tokens) == (
        0.6,
        0.5,
        20,
        1.1,
        77,
    )
    assert SamplingParams().with_generation_config_defaults({"do_sample": False}).is_greedy
    plain = SamplingParams()
    assert plain.with_generation_config_defaults({}) is plain
    assert plain.resolved("temperature") == 1.0 and plain.resolved("top_k") == 0 and not plain.is_greedy


def test_wire_format_round_trips_and_rejects_unknown_keys():
    params = SamplingParams(n=2, stop="END", seed=5, logprobs=3, bad_words=["x"])
    assert params.stop == ["END"]
    assert SamplingParams.from_dict(params.to_dict()) == params
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"temprature": 1})
    req = EngineCoreRequest("r1", [1, 2, 3], params, arrival_time=1.0, priority=2)
    assert EngineCoreRequest.from_dict(req.to_dict()) == req
    assert pickle.loads(pickle.dumps(req)) == req
    out = EngineCoreOutput("r1", 1, [7], [{7: -0.1, 8: -2.0}], None, True, "stop", 7, 64)
    assert EngineCoreOutput.from_dict(out.to_dict()) == out == pickle.loads(pickle.dumps(out))
    assert params.child(1).seed == 6 and params.child(1).n == 1
    assert choice_request_id("r", 0, 1) == "r" and choice_request_id("r", 1, 2) == "r#1"


def test_outputs_read_fastdeploy_style():
    outs = CompletionOutputs([CompletionOutput(0, "a", [1], finish_reason="stop"), CompletionOutput(1, "b", [2])])
    assert outs.text == "a" and outs.finish_reason == "stop" and outs[1].text == "b" and len(outs) == 2
    with pytest.raises(AttributeError):
        _ = CompletionOutputs([]).text


def _req(params: SamplingParams, output=(), seed=None) -> Request:
    req = Request("r", [3, 4], params, eos_token_ids=(0,), max_total_tokens=100)
    for t in output:
        req.append_output_token(t)
    req.sample_seed = seed
    return req


def test_sampler_filters():
    logits = np.log(np.array([[0.05, 0.4, 0.3, 0.2, 0.05]], dtype=np.float32))
    # top_k=1 and min_p near 1 both leave only the best token
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, min_p=0.9)):
        assert all(Sampler()(logits, [_req(params, seed=s)]).token_ids == [1] for s in range(20))
    # top_p=0.6 keeps tokens 1 and 2 only
    seen = {
        Sampler()(logits, [_req(SamplingParams(temperature=1.0, top_p=0.6), seed=s)]).token_ids[0] for s in range(60)
    }
    assert seen == {1, 2}
    # min_tokens masks eos (token 0) even when it is the best token
    eos_best = np.array([[5.0, 1.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    assert Sampler()(eos_best, [_req(SamplingParams(temperature=0, min_tokens=1))]).token_ids == [1]
    # bad words: single tokens always, sequences only after their prefix
    params = SamplingParams(temperature=0, bad_words_token_ids=[[1], [4, 2]])
    assert Sampler()(logits, [_req(params, output=[3])]).token_ids == [2]
    assert Sampler()(logits, [_req(params, output=[4])]).token_ids == [3]
