"""Tensor parallelism with real rank processes on gloo over loopback.

Tiny random Llama checkpoints (heads split over the ranks; fewer KV heads than ranks, each
replicated) give exactly transformers' greedy tokens under chunked prefill, prefix-cache hits
and preemption, and wint8 gives the tokens of one rank under wint8. The default model (9 query
and 3 KV heads: split 2 + 1 over two ranks) gives transformers' 64 greedy tokens and, over a
batch of chat and raw prompts, the tokens and first-step log-probabilities of one rank. A rank
SIGKILLed ends the engine with an error naming it; heads that cannot be split are refused with
the numbers.
"""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.engine.engine_core import EngineCore
from fastdeploy_core.errors import ConfigError, EngineDeadError
from tests.engine.test_engine_tiny import PROMPTS, _hf_greedy, _save_tiny, greedy, run, tokens

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

TINY = {
    # 4 query heads over 2 KV heads: one KV head (and its 2 query heads) per rank
    "kv_heads_split": {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False},
    # one KV head, replicated on both ranks; 2 query heads each
    "kv_head_replicated": {"num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": True},
}


def tp_core(path: str, size: int = 2, **kw) -> EngineCore:
    settings = {"model": path, "max_model_len": 128, "block_size": 4, "num_gpu_blocks_override": 256,
                "tensor_parallel_size": size}
    settings.update(kw)
    return EngineCore(EngineArgs.create(**settings))


def close(core: EngineCore) -> None:
    core.runner.close()


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_llama_tp2_matches_transformers_chunked_cached_and_preempted(tmp_path, name):
    model = _save_tiny(str(tmp_path), TINY[name])
    refs = [_hf_greedy(model, p, 12) for p in PROMPTS]
    # 10 blocks of 4 tokens hold one 40-token sequence: five requests preempt one another;
    # 5-token steps chunk every prompt
    core = tp_core(str(tmp_path), num_gpu_blocks_override=10, max_model_len=40, max_num_batched_tokens=5)
    try:
        assert core.config_info()["tensor_parallel_size"] == 2
        outs = run(core, [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)])
        assert core.get_stats()["num_preemptions"] > 0
        for i in range(len(PROMPTS)):
            assert tokens(outs, f"r{i}") == refs[i], f"prompt {i}"
        run(core, [("warm", PROMPTS[1], greedy())])
        again = run(core, [("hit", PROMPTS[1], greedy())])  # its full blocks are cached now
        assert again[("hit", 0)][0].num_cached_tokens == 20
        assert tokens(again, "hit") == refs[1]
    finally:
        close(core)


def test_grouped_wint8_tp2_gives_the_tokens_of_one_rank(tmp_path):
    # Groups of 32 inputs never straddle the ranks' shares, so each rank's int8 codes and scales
    # are exactly its share of one rank's. (Per-channel wint8 scales a row-parallel layer over
    # each rank's share of the inputs: a different, equally valid, quantization.)
    _save_tiny(str(tmp_path), TINY["kv_heads_split"])
    method = '{"quantization": "wint8", "group_size": 32}'
    one = tp_core(str(tmp_path), size=1, quantization=method)
    two = tp_core(str(tmp_path), quantization=method)
    try:
        requests = [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)]
        single, split = run(one, requests), run(two, requests)
        for i in range(len(PROMPTS)):
            assert tokens(split, f"r{i}") == tokens(single, f"r{i}"), f"prompt {i}"
        assert two.config_info()["linear_weights"] == "wint8"
    finally:
        close(two)


def test_bf16_kv_cache_tp2_gives_the_tokens_of_one_rank(tmp_path):
    """--kv-cache-dtype bf16 under two ranks: each rank holds its KV heads' bfloat16 blocks."""
    _save_tiny(str(tmp_path), TINY["kv_heads_split"])
    one = tp_core(str(tmp_path), size=1, kv_cache_dtype="bf16")
    two = tp_core(str(tmp_path), kv_cache_dtype="bf16", max_num_batched_tokens=5)
    try:
        requests = [(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)]
        single, split = run(one, requests), run(two, requests)
        for i in range(len(PROMPTS)):
            assert tokens(split, f"r{i}") == tokens(single, f"r{i}"), f"prompt {i}"
        assert two.config_info()["kv_cache_spec"]["dtype"] == "bfloat16"
    finally:
        close(two)


def test_heads_that_do_not_split_are_refused_with_the_numbers(tmp_path):
    # 3 query heads, 1 KV head: two ranks would each need 1.5 query heads of the replicated KV head
    # (transformers refuses to build such a config; the check runs before any weight loads)
    _save_tiny(str(tmp_path), {"num_attention_heads": 4, "num_key_value_heads": 1})
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(num_attention_heads=3, head_dim=16)
    config_path.write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        tp_core(str(tmp_path))
    message = str(info.value)
    assert "tensor_parallel_size: got 2" in message and "3 attention heads and 1 KV heads" in message
    assert info.value.param == "tensor_parallel_size"


def test_a_killed_rank_ends_the_engine_with_its_name(tmp_path):
    _save_tiny(str(tmp_path), TINY["kv_heads_split"])
    core = tp_core(str(tmp_path))
    try:
        run(core, [("warm", PROMPTS[0], greedy(max_tokens=2))])
        victim = core.runner.ranks[1].proc
        victim.kill()
        victim.wait()
        started = time.monotonic()
        with pytest.raises(EngineDeadError) as info:
            run(core, [("after", PROMPTS[3], greedy())])
        assert time.monotonic() - started < 10
        assert "rank 1 died (exit status -9)" in str(info.value)
        assert all(r.proc.poll() is not None for r in core.runner.ranks) or not core.runner.ranks
    finally:
        close(core)


def test_default_model_tp2_matches_transformers_and_one_rank():
    from fastdeploy_core import LLM, SamplingParams
    from tests.support.reference import NUM_GREEDY_TOKENS, transformers_smollm2_reference

    reference = transformers_smollm2_reference()
    prompts = [
        reference["ids"].tolist(),
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        [1, 2, 3, 4],
    ]
    chat = [[{"role": "user", "content": "Name three colours."}]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    results = {}
    for size in (1, 2):
        with LLM(tensor_parallel_size=size, max_model_len=512, num_gpu_blocks_override=64, max_num_seqs=8) as llm:
            long = llm.generate([reference["ids"].tolist()], SamplingParams(
                temperature=0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True), use_tqdm=False)[0]
            assert long.outputs[0].token_ids == reference["generated"].tolist(), f"tp={size}"
            batch = llm.generate(prompts, params, use_tqdm=False) + llm.chat(chat, params, use_tqdm=False)
            results[size] = [(o.outputs[0].token_ids, o.outputs[0].logprobs[0]) for o in batch]
            bm = llm.engine.core.block_manager
            assert bm.num_free_blocks == bm.num_blocks
    worst = 0.0
    for (ids1, first1), (ids2, first2) in zip(results[1], results[2]):
        assert ids2 == ids1
        assert first2.keys() == first1.keys()
        worst = max([worst] + [abs(first2[token] - value) for token, value in first1.items()])
    # The ranks sum the row-parallel products in another order than one rank does: log-probs
    # (a logit minus the log-sum over 49152 of them) moved by at most 1.1e-4 when measured.
    assert worst < 2e-4, worst


def test_speculative_ngram_under_tp2_gives_transformers_tokens(tmp_path):
    model = _save_tiny(str(tmp_path), TINY["kv_heads_split"])
    prompts = [p * 3 for p in PROMPTS[:3]]  # repeats give the n-gram proposer something to find
    refs = [_hf_greedy(model, p, 12) for p in prompts]
    core = tp_core(str(tmp_path), speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        outs = run(core, [(f"r{i}", p, greedy()) for i, p in enumerate(prompts)])
        for i in range(len(prompts)):
            assert tokens(outs, f"r{i}") == refs[i], f"prompt {i}"
        assert core.speculative_stats()["spec_decode_num_draft_tokens_total"] > 0
    finally:
        close(core)
