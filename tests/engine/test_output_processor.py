"""Stop strings and streaming deltas of the OutputProcessor, with a toy tokenizer (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fastdeploy_core.engine.output_processor import OutputProcessor
from fastdeploy_core.engine.outputs import EngineCoreOutput
from fastdeploy_core.engine.sampling_params import SamplingParams

VOCAB = ["a", "b", "ab", "ba", " ", "abc", "c", "<eos>"]
EOS = 7


class ToyTokenizer:
    """Each id is a fixed piece of text; ``<eos>`` is special."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i == EOS))

    def encode(self, text, add_special_tokens=False):
        return [VOCAB.index(ch) for ch in text]


def expected_text(tokens: list[int], stops: list[str], include: bool) -> tuple[str, str | None, int]:
    """Reference: the first prefix (in tokens) whose text holds a stop string, cut at its first match."""
    text = ""
    for k, tok in enumerate(tokens):
        text += "" if tok == EOS else VOCAB[tok]
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            pos, stop = min(hits)
            return text[: pos + (len(stop) if include else 0)], stop, k + 1
    return text, None, len(tokens)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, len(VOCAB) - 2), min_size=1, max_size=30),
    stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_stop_strings_and_deltas(tokens, stops, include):
    proc = OutputProcessor(ToyTokenizer())
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, temperature=0)
    proc.add_request("r", None, [4], params)
    want, want_stop, consumed = expected_text(tokens, stops, include)
    deltas, aborted, final = [], [], None
    for k, tok in enumerate(tokens):
        last = k == len(tokens) - 1
        res = proc.process_outputs(
            [EngineCoreOutput("r", 0, [tok], finished=last, finish_reason="length" if last else None)]
        )
        aborted += res.reqs_to_abort
        for out in res.request_outputs:
            deltas.append(out.outputs[0].delta_text)
            final = out
        if final is not None and final.finished:
            break
    assert final.finished and final.outputs.text == want and "".join(deltas) == want
    if want_stop is not None:
        assert final.outputs.finish_reason == "stop" and final.outputs.stop_reason == want_stop
        assert aborted == (["r"] if consumed < len(tokens) else [])  # the core must stop it unless it ended anyway
        assert len(final.outputs.token_ids) == consumed
    else:
        assert final.outputs.finish_reason == "length" and aborted == []
    if not include:
        assert not any(s in d for d in deltas for s in stops)
    assert not proc.has_unfinished_requests()


def test_stop_strings_at_one_place_the_shorter_wins():
    # one token brings "ab": stops "ab" and "a" both start at 0; "a" ends first
    proc = OutputProcessor(ToyTokenizer())
    proc.add_request("r", None, [4], SamplingParams(stop=["ab", "a"], include_stop_str_in_output=True))
    out = proc.process_outputs([EngineCoreOutput("r", 0, [2])]).request_outputs[0]
    assert out.outputs[0].text == "a" and out.outputs[0].stop_reason == "a"


def test_n_choices_finish_independently_and_eos_is_hidden():
    proc = OutputProcessor(ToyTokenizer())
    proc.add_request("p", "prompt", [1, 2], SamplingParams(n=2, stop=["c"], temperature=1.0))
    res = proc.process_outputs([EngineCoreOutput("p", 0, [0]), EngineCoreOutput("p", 1, [6])])
    assert res.reqs_to_abort == ["p#1"]  # choice 1 hit the stop string
    out = res.request_outputs[0]
    assert not out.finished and out.outputs[1].finish_reason == "stop" and out.outputs[1].text == ""
    res = proc.process_outputs([EngineCoreOutput("p", 0, [1, EOS], finished=True, finish_reason="stop")])
    out = res.request_outputs[0]
    assert out.finished and out.outputs[0].text == "ab" and out.outputs[0].token_ids == [0, 1, EOS]
    assert out.metrics.num_generated_tokens == 4 and out.metrics.finish_time is not None
    # aborting an unknown or finished request is harmless
    assert proc.abort_request("p") is None


def test_abort_ends_unfinished_choices_with_abort():
    proc = OutputProcessor(ToyTokenizer())
    proc.add_request("q", None, [1], SamplingParams(n=2, temperature=1.0))
    proc.process_outputs(
        [EngineCoreOutput("q", 0, [0], finished=True, finish_reason="length"), EngineCoreOutput("q", 1, [1])]
    )
    out = proc.abort_request("q")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["length", "abort"]
    assert out.outputs[1].text == "b" and not proc.has_unfinished_requests()
