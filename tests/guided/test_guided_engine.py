"""Guided decoding in the engine on the default model (SmolLM2-135M-Instruct): constrained
outputs hold, unconstrained rows of the same batch are unchanged, a constraint cut by max_tokens
ends with "length", and a preempted (recomputed) constrained request gives the same tokens."""

from __future__ import annotations

import json
import os
import re

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest

from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.errors import InvalidRequestError
from fastdeploy_core.guided.params import GuidedDecodingParams as G

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "enum": ["chess", "running", "music"]}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
PLAIN = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm():
    from fastdeploy_core import LLM

    return LLM(max_model_len=512, num_gpu_blocks_override=128, block_size=16, max_num_seqs=8)


def greedy(max_tokens: int, guided: G | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, guided_decoding=guided)


def test_schema_choice_regex_hold_and_unconstrained_rows_keep_their_tokens(llm):
    alone = llm.generate(PLAIN, greedy(24), use_tqdm=False)
    prompts = PLAIN + [CHAT.format("Describe a person as JSON."), "Is the sky blue? Answer:", "Call me at"]
    params = [greedy(24), greedy(24), greedy(80, G(json=PERSON)), greedy(8, G(choice=["yes", "no", "maybe"])),
              greedy(20, G(regex=r"\d{3}-\d{4}"))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs.token_ids for o in outs[:2]] == [o.outputs.token_ids for o in alone]
    person = json.loads(outs[2].outputs.text)
    jsonschema.validate(person, PERSON)
    assert outs[2].outputs.finish_reason == "stop"
    assert outs[3].outputs.text in ("yes", "no", "maybe")
    assert re.fullmatch(r"\d{3}-\d{4}", outs[4].outputs.text)
    sampled = llm.generate([CHAT.format("A person as JSON")] * 3,
                           [SamplingParams(temperature=1.0, seed=s, max_tokens=80, guided_decoding=G(json=PERSON))
                            for s in range(3)], use_tqdm=False)
    for o in sampled:
        jsonschema.validate(json.loads(o.outputs.text), PERSON)


def test_max_tokens_cuts_a_constraint_with_length(llm):
    out = llm.generate([CHAT.format("A person as JSON")], greedy(5, G(json=PERSON)), use_tqdm=False)[0]
    assert out.outputs.finish_reason == "length"
    assert len(out.outputs.token_ids) == 5
    assert out.outputs.text.startswith('{"name":')


def test_json_object_and_lark_grammar(llm):
    outs = llm.generate(
        [CHAT.format("Reply with a JSON object with the keys name and color of a cat."), "Pick a color:"],
        [greedy(60, G(json_object=True)), greedy(10, G(grammar='start: "color: " COLOR\nCOLOR: "red" | "blue"'))],
        use_tqdm=False,
    )
    assert isinstance(json.loads(outs[0].outputs.text), dict)
    assert outs[1].outputs.text in ("color: red", "color: blue")


def test_invalid_constraints_fail_before_queueing_with_the_backends_message(llm):
    with pytest.raises(InvalidRequestError, match="Invalid type: objectx"):
        llm.generate(["x"], greedy(4, G(json={"type": "objectx"})), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="unclosed group"):
        llm.generate(["x"], greedy(4, G(regex="a(b")), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_preempted_constrained_request_recomputes_to_the_same_tokens():
    from fastdeploy_core import LLM

    story = "People of the village: a baker, a smith, a weaver, a farmer and a fisher live by the river. " * 2
    prompts = [CHAT.format(f"{story}Describe person number {i} as JSON.") for i in range(4)]
    params = greedy(60, G(json=PERSON))
    roomy = LLM(max_model_len=256, num_gpu_blocks_override=64, block_size=16, max_num_seqs=4)
    expected = [o.outputs.token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    del roomy
    tight = LLM(max_model_len=160, num_gpu_blocks_override=10, block_size=16, max_num_seqs=4)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.get_stats()["num_preemptions"] > 0
    assert [o.outputs.token_ids for o in got] == expected
    for o in got:
        jsonschema.validate(json.loads(o.outputs.text), PERSON)
