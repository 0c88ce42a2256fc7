"""``draft_model`` speculative decoding: tokens identical to speculation off, the draft's own
cache rewound on rejection and freed with its requests, and the refusals of bad drafts.

Tiny random Llamas built here: the target (vocabulary 128), a smaller draft sharing its
vocabulary, and one whose vocabulary differs. A self-draft is the target's checkpoint quantized.
"""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.devices.current import current_ops
from fastdeploy_core.engine.outputs import EngineCoreRequest
from fastdeploy_core.errors import ConfigError
from fastdeploy_core.spec_decode import DraftRequest, build_proposer, proposer_class
from fastdeploy_core.spec_decode.draft_model import DraftModelProposer
from tests.spec_decode.engine_runs import (
    PROMPTS,
    assert_draft_cache_empty,
    batch,
    greedy,
    make_core,
    run,
    save_tiny_llama,
)

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_models")
    return {
        "target": save_tiny_llama(str(root / "target"), 0),
        "small": save_tiny_llama(str(root / "small"), 1, hidden=32, layers=1),
        "other_vocab": save_tiny_llama(str(root / "other_vocab"), 2, vocab=96, hidden=32, layers=1),
    }


@pytest.fixture(scope="module")
def reference(models):
    """Speculation off, per engine setting."""
    cache: dict = {}

    def get(settings: dict) -> dict:
        key = json.dumps(settings, sort_keys=True)
        if key not in cache:
            cache[key] = run(make_core(models["target"], None, **settings), batch())
        return cache[key]

    return get


SETTINGS = {
    "plain": {},
    "preemption": {"num_gpu_blocks_override": 24},  # 96 slots for 11 sequences
    "chunked": {"max_num_batched_tokens": 8},  # chunked prompts, drafts cut by the step budget
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("quantization", ["wint8", "wint4"])
def test_self_draft_gives_the_tokens_of_speculation_off(models, reference, quantization, setting):
    settings = SETTINGS[setting]
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "quantization": quantization}
    core = make_core(models["target"], spec, **settings)
    assert current_ops() is core.runner.ops  # loading the draft left the target's ops table installed
    assert run(core, batch()) == reference(settings)
    stats = core.get_stats()
    assert stats["spec_decode_method"] == "draft_model"
    assert stats["spec_decode_num_accepted_tokens_total"] > 0, stats
    assert stats["spec_decode_num_draft_tokens_total"] >= stats["spec_decode_num_accepted_tokens_total"]
    if setting == "preemption":
        assert stats["num_preemptions"] > 0
    info = core.config_info()["speculative_config"]
    assert info["quantization"] == quantization and info["draft"]["model"] == models["target"]


@pytest.mark.parametrize("setting", ["plain", "chunked"])
def test_a_separate_small_draft_gives_the_tokens_of_speculation_off(models, reference, setting):
    settings = SETTINGS[setting]
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "model": models["small"]}
    core = make_core(models["target"], spec, **settings)
    assert run(core, batch()) == reference(settings)
    stats = core.get_stats()
    assert stats["spec_decode_num_draft_tokens_total"] > 0, stats
    assert core.config_info()["speculative_config"]["draft"]["model"] == models["small"]


def test_a_self_draft_guesses_with_the_targets_float32_head(models, reference):
    """A self-draft's guesses are argmaxes of the target's own float32 head (the device's greedy
    head where it has one) over the draft's hidden states, not of a quantized copy of it; a
    separate draft keeps its own head."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "quantization": "wint4"}
    core = make_core(models["target"], spec)
    target_head, draft_model = core.runner.model.lm_head, core.proposer.runner.model
    shared = target_head.greedy_state is not None  # a cpu with int8 dot products (AVX2 or VNNI)
    assert core.proposer.shares_target_head is shared
    assert (draft_model.lm_head is target_head) is shared
    assert core.config_info()["speculative_config"]["draft"]["lm_head"] == (
        "the target's (float32, greedy head)" if shared else "its own"
    )
    if shared:  # the guesses are the target head's argmax of the draft's hidden states
        hidden = paddle.to_tensor(np.random.default_rng(0).standard_normal((3, 64)).astype("float32"))
        np.testing.assert_array_equal(
            draft_model.compute_greedy_tokens(hidden),
            np.argmax(core.runner.model.compute_logits(hidden).numpy(), axis=1),
        )
    assert run(core, batch()) == reference({})
    assert core.get_stats()["spec_decode_num_accepted_tokens_total"] > 0

    separate = make_core(models["target"], {"method": "draft_model", "num_speculative_tokens": 3, "model": models["small"]})
    assert separate.proposer.shares_target_head is False
    assert separate.proposer.runner.model.lm_head is not separate.runner.model.lm_head


def test_a_quantized_separate_draft_runs(models, reference):
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": models["small"], "quantization": "wint8"}
    assert run(make_core(models["target"], spec), batch()) == reference({})


def test_a_bfloat16_target_speculates_with_a_quantized_or_a_bfloat16_draft(models):
    """``--dtype bfloat16`` is about the linear layers, as a quantization is: a quantized self-draft
    runs its own format, an unquantized draft takes bfloat16 like the target; either way the
    tokens are those of the bfloat16 target with speculation off."""
    reference = run(make_core(models["target"], None, dtype="bfloat16"), batch())
    for spec, draft_weights in (
        ({"method": "draft_model", "num_speculative_tokens": 3, "quantization": "wint8"}, "wint8"),
        ({"method": "draft_model", "num_speculative_tokens": 3, "model": models["small"]}, "bfloat16"),
    ):
        core = make_core(models["target"], spec, dtype="bfloat16")
        assert core.runner.describe()["linear_weights"] == "bfloat16"
        assert core.proposer.runner.describe()["linear_weights"] == draft_weights
        assert run(core, batch()) == reference
        assert core.get_stats()["spec_decode_num_accepted_tokens_total"] > 0


def test_the_draft_cache_is_freed_on_abort_and_preemption(models):
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "quantization": "wint8"}
    core = make_core(models["target"], spec, num_gpu_blocks_override=24)
    proposer = core.proposer
    forgotten: list[str] = []
    forget = proposer.forget
    proposer.forget = lambda rid: (forgotten.append(rid), forget(rid))[1]
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(f"g{i}", prompt, greedy(60)))
    for _ in range(12):
        core.step()
    assert proposer._states, "no request is drafting yet"
    held = sum(len(s.blocks) for s in proposer._states.values())
    assert proposer.num_free_blocks == proposer.num_blocks - held
    victim = next(iter(proposer._states))
    core.abort_requests([victim])
    assert victim not in proposer._states and victim in forgotten
    assert proposer.num_free_blocks == proposer.num_blocks - sum(len(s.blocks) for s in proposer._states.values())
    while core.has_unfinished_requests():
        core.step()
    assert core.scheduler.num_preemptions > 0
    preempted_forgotten = [r for r in forgotten if r != victim]
    assert len(preempted_forgotten) > len(PROMPTS) - 1  # finished ones, plus preempted ones
    assert_draft_cache_empty(core)


def _proposer(models, spec: dict, num_blocks: int = 64, **kw) -> DraftModelProposer:
    args = EngineArgs.create(model=models["target"], max_model_len=96, block_size=4, speculative_config=spec, **kw)
    proposer = build_proposer(args, vocab_size=128, max_model_len=96, num_blocks=num_blocks)
    assert isinstance(proposer, DraftModelProposer)
    return proposer


def test_rejected_drafts_are_rolled_back(models):
    """After a rejection the draft's cache rewinds to the agreeing prefix: its next guesses are
    those of a fresh draft that computed the whole context from scratch."""
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "quantization": "wint8"}
    kept, fresh = _proposer(models, spec), _proposer(models, spec)
    context = list(PROMPTS[1])
    first = kept.propose([DraftRequest("r", context, len(context), 4)])[0]
    assert len(first) == 4
    assert kept._states["r"].fed == context + first[:3]  # the context and the first 3 guesses
    # The target accepted one guess and then disagreed with the second; steps without drafts
    # followed (their budget was spent), so the rejected guesses are not the last token.
    wrong = [(t + 1 + i) % 128 for i, t in enumerate(first[1:3])]
    context = context + [first[0], *wrong, 77, 78]
    again = kept.propose([DraftRequest("r", context, len(PROMPTS[1]), 4)])[0]
    assert again == fresh.propose([DraftRequest("r", context, len(PROMPTS[1]), 4)])[0]
    assert kept._states["r"].fed == context + again[:3]
    # a request that guessed nothing new: only its last token is computed again
    same = kept.propose([DraftRequest("r", context + again[:3], len(PROMPTS[1]), 1)])[0]
    assert same == fresh.propose([DraftRequest("r2", context + again[:3], len(PROMPTS[1]), 1)])[0]
    kept.forget("r")
    assert kept.num_free_blocks == kept.num_blocks


def test_a_request_the_draft_pool_cannot_hold_gets_no_draft(models):
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "quantization": "wint8"}
    proposer = _proposer(models, spec, num_blocks=8)  # the pool: one sequence of max_model_len, 24 blocks
    assert proposer.num_blocks == 24
    long = [(7 * i) % 128 for i in range(80)]
    first, second = proposer.propose([DraftRequest("a", long, 80, 3), DraftRequest("b", long[:40], 40, 3)])
    assert len(first) == 3 and second == []  # "a" holds 21 blocks; "b" would need 11
    assert "b" not in proposer._states and proposer.num_free_blocks == 3
    proposer.forget("a")
    assert proposer.propose([DraftRequest("b", long[:40], 40, 3)])[0] == first_guesses(models, spec, long[:40])
    proposer.forget("b")
    assert proposer.num_free_blocks == 24


def first_guesses(models, spec: dict, tokens: list[int]) -> list[int]:
    return _proposer(models, spec).propose([DraftRequest("x", tokens, len(tokens), 3)])[0]


def test_long_catch_up_is_chunked_by_the_step_budget(models):
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": models["small"]}
    whole = _proposer(models, spec)
    chunked = _proposer(models, spec, max_num_batched_tokens=5)
    calls = []
    execute = chunked.runner.execute_model
    chunked.runner.execute_model = lambda out: (calls.append(out.num_scheduled_tokens), execute(out))[1]
    requests = [DraftRequest("a", PROMPTS[1], 20, 2), DraftRequest("b", PROMPTS[3], 18, 2)]
    assert chunked.propose(requests) == whole.propose(requests)
    assert max(calls) <= 5 and sum(calls) == len(PROMPTS[1]) + len(PROMPTS[3]) + 2


def test_a_draft_with_another_vocabulary_is_refused(models):
    spec = {"method": "draft_model", "model": models["other_vocab"]}
    with pytest.raises(ConfigError) as info:
        make_core(models["target"], spec)
    assert info.value.param == "speculative_config.model"
    assert "the draft's vocabulary has 96 tokens, the target's 128" in info.value.message


def _with_tokenizer(src: str, dst: str, vocab: list[str]) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    shutil.copytree(src, dst)
    tokenizer = Tokenizer(WordLevel({word: i for i, word in enumerate(vocab)}, unk_token=vocab[0]))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(os.path.join(dst, "tokenizer.json"))
    return dst


def test_a_draft_with_another_tokenizer_is_refused(models, tmp_path):
    words = [f"w{i}" for i in range(128)]
    target = _with_tokenizer(models["target"], str(tmp_path / "target"), words)
    same = _with_tokenizer(models["small"], str(tmp_path / "same"), words)
    other = _with_tokenizer(models["small"], str(tmp_path / "other"), words[1:] + words[:1])
    core = make_core(target, {"method": "draft_model", "model": same})  # the same tokenizer: accepted
    assert run(core, [("a", PROMPTS[0], greedy(8))]) == run(make_core(target, None), [("a", PROMPTS[0], greedy(8))])
    with pytest.raises(ConfigError) as info:
        make_core(target, {"method": "draft_model", "model": other})
    assert info.value.param == "speculative_config.model"
    assert "must share the target's tokenizer" in info.value.message
    with pytest.raises(ConfigError, match="the draft has no tokenizer to compare"):
        make_core(target, {"method": "draft_model", "model": models["small"]})


@pytest.mark.parametrize(
    "spec, param, says",
    [
        ({"method": "draft_model", "quantization": "wint3"}, "speculative_config.quantization", "wint3"),
        ({"method": "draft_model"}, "speculative_config.model", "method 'draft_model' needs a draft"),
        ({"method": "draft_model", "model": "/no/such/draft"}, "speculative_config.model", "/no/such/draft"),
        ({"method": "draft_model", "quantization": "wint8", "max_ngram_size": 3},
         "speculative_config.max_ngram_size", "method 'draft_model' does not read it"),
    ],
)
def test_bad_drafts_are_refused_naming_the_key(models, spec, param, says):
    with pytest.raises(ConfigError) as info:
        make_core(models["target"], spec)
    assert info.value.param == param
    assert says in info.value.message


def test_ngram_still_refuses_the_draft_keys():
    for key, value in (("model", "/draft"), ("quantization", "wint4")):
        args = EngineArgs.create(speculative_config={"method": "ngram", key: value})
        with pytest.raises(ConfigError) as info:
            proposer_class(args.speculative)
        assert info.value.param == f"speculative_config.{key}"
        assert "method 'ngram' does not read it" in info.value.message


@pytest.mark.parametrize("quantization", ["wint4", "wint8"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_verify_and_draft_steps_replay_captured_graphs(models, batch_size, quantization):
    """With a self-draft every speculating row scores 1 + k tokens: the target's verify steps
    replay a captured (B, 1 + k) graph, the draft's guesses (B, 1) ones and, where a row's drafts
    were all kept, its catch-up steps a (B, 2) one (the wint8 draft agrees with the target often
    enough for that shape to recur here); the tokens are those of speculation off, and of the
    same run all eager."""
    requests = [(f"g{i}", p, greedy(60)) for i, p in enumerate(PROMPTS[3:] + PROMPTS[:3])][:batch_size]
    reference = run(make_core(models["target"], None), requests)
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "quantization": quantization}
    assert run(make_core(models["target"], spec, enforce_eager=True), requests) == reference
    core = make_core(models["target"], spec)
    assert run(core, requests) == reference
    target, draft = core.runner.graphs, core.proposer.runner.graphs
    assert target.replays[(batch_size, 3)] > 0, dict(target.replays)
    assert draft.replays[(batch_size, 1)] > 0, dict(draft.replays)
    if quantization == "wint8":
        assert draft.replays[(batch_size, 2)] > 0, dict(draft.replays)
    assert core.get_stats()["spec_decode_num_accepted_tokens_total"] > 0


def test_a_last_catch_up_step_of_unequal_rows_is_padded_to_one_length(models):
    """After a verify step one row has 2 tokens to catch up (its drafts were all kept), the other
    1: the shorter row computes its last cached token again, so the step has 2 tokens per row
    (a shape the draft's runner captures) and each row still gets its guesses."""
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "quantization": "wint8"}
    proposer = _proposer(models, spec)
    a, b = list(PROMPTS[1]), list(PROMPTS[3])
    pa, pb = len(a) - 4, len(b) - 4  # the last 4 tokens of each were generated
    first_a, first_b = proposer.propose([DraftRequest("a", a, pa, 2), DraftRequest("b", b, pb, 2)])
    steps = []
    execute = proposer.runner.execute_model
    proposer.runner.execute_model = lambda out: (
        steps.append([(r.num_computed_tokens, r.num_new_tokens) for r in out.requests]), execute(out)
    )[1]
    a_next = a + first_a + [5]  # both drafts kept, then the target's token
    b_next = b + [(first_b[0] + 1) % 128]  # the first draft rejected
    again = proposer.propose([DraftRequest("a", a_next, pa, 2), DraftRequest("b", b_next, pb, 2)])
    assert [len(d) for d in again] == [2, 2]
    # catch-up: a computes first_a[1] and 5; b steps back over its last generated token
    assert steps[0] == [(len(a) + 1, 2), (len(b) - 1, 2)]
    assert steps[1:] == [[(len(a_next), 1), (len(b_next), 1)]]
    assert proposer._states["b"].fed == b_next + again[1][:1]
    for rid in ("a", "b"):
        proposer.forget(rid)


@pytest.mark.parametrize("chunk", [None, 7])
def test_the_draft_computes_the_prompt_in_the_targets_prompt_steps(models, chunk):
    """After each of the target's prompt steps the draft has computed the same prompt tokens
    (whole, or chunk by chunk), so the first speculative step feeds the draft one token (the
    target's first) instead of the whole prompt; the tokens stay those of speculation off."""
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "quantization": "wint8"}
    settings = {"max_num_batched_tokens": chunk} if chunk else {}
    prompt = list(PROMPTS[1])
    reference = run(make_core(models["target"], None, **settings), [("r", prompt, greedy(12))])
    core = make_core(models["target"], spec, **settings)
    fed = []
    execute = core.proposer.runner.execute_model
    core.proposer.runner.execute_model = lambda out: (
        fed.append([(r.num_computed_tokens, r.num_new_tokens, r.samples) for r in out.requests]), execute(out)
    )[1]
    core.add_request(EngineCoreRequest("r", prompt, greedy(12)))
    outs, held = [], []
    while core.has_unfinished_requests():
        for out in core.step():
            outs.extend(out.new_token_ids)
        state = core.proposer._states.get("r")
        held.append(len(state.fed) if state else 0)
    assert outs == reference[("r", 0)]
    prompt_steps = -(-len(prompt) // chunk) if chunk else 1
    # the draft's prompt steps: the target's chunks, nothing sampled
    want = [[(i * (chunk or len(prompt)), min(chunk or len(prompt), len(prompt) - i * (chunk or len(prompt))), False)]
            for i in range(prompt_steps)]
    assert fed[:prompt_steps] == want
    assert held[prompt_steps - 1] == len(prompt)
    # the first speculative step: one token (the target's first), which gives the first guess
    assert fed[prompt_steps] == [(len(prompt), 1, True)]
    assert core.get_stats()["spec_decode_num_draft_tokens_total"] > 0
