"""A model plugin against transformers: the same greedy tokens and logits, however it is batched.

For plugin authors' tests (torch CPU and transformers are the reference; both are test-only
dependencies). A test builds a tiny random transformers model, saves it as safetensors, and
calls:

- :func:`hf_reference`: transformers' last-position logits and greedy continuation per prompt;
- :func:`check_paged`: the plugin's model on the reference ops over hand-made ragged batches
  (:class:`~fastdeploy_core.testing.paged_harness.PagedHarness`): each prompt alone, all of
  them batched with chunked prefill over scrambled block tables, and a prefix-cache hit (a
  sequence whose first blocks another sequence already filled);
- :func:`check_engine`: the whole engine (the device the machine selects, the plugin found
  through its entry point): alone, batched, chunked, prefix-cache hits and preemption.
"""

from __future__ import annotations

import numpy as np

from fastdeploy_core.testing.paged_harness import PagedHarness

#: Last-position logits must agree with transformers' within ``atol + rtol * |reference|``.
LOGITS_ATOL = 1e-4
LOGITS_RTOL = 1e-4


def hf_reference(hf_model, prompts: list[list[int]], new_tokens: int) -> list[tuple[np.ndarray, list[int]]]:
    """Per prompt: transformers' float32 last-position logits and its greedy ``new_tokens`` (eos ignored)."""
    import torch

    from fastdeploy_core.testing.perplexity import greedy_sequence

    out = []
    for prompt in prompts:
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt])).logits[0, -1].float().numpy()
        out.append((logits, greedy_sequence(hf_model, prompt, new_tokens)[len(prompt) :]))
    return out


def _tables(prompts, new_tokens: int, block_size: int, seed: int) -> tuple[int, list[list[int]]]:
    per_seq = -(-(max(map(len, prompts)) + new_tokens) // block_size)
    order = np.random.default_rng(seed).permutation(per_seq * len(prompts) + per_seq + 1).tolist()
    return len(order), [order[i * per_seq : (i + 1) * per_seq] for i in range(len(prompts) + 1)]


def _assert_same(what: str, tokens, logits, reference) -> None:
    ref_logits, ref_tokens = reference
    assert tokens == ref_tokens, f"{what}: tokens {tokens}, transformers {ref_tokens}"
    np.testing.assert_allclose(logits, ref_logits, atol=LOGITS_ATOL, rtol=LOGITS_RTOL, err_msg=what)


def check_paged(model, prompts: list[list[int]], new_tokens: int, references) -> None:
    """The model's tokens and first logits equal transformers' alone, batched with chunked
    prefill (block size 3, chunks of 5), and on a prefix-cache hit."""
    for i, prompt in enumerate(prompts):
        harness = PagedHarness(model, num_blocks=-(-(len(prompt) + new_tokens) // 16) + 1, block_size=16)
        table = list(range(1, harness.kv_caches[0][0].shape[0]))
        generated, first = harness.generate([prompt], new_tokens, [table])
        _assert_same(f"prompt {i} alone", generated[0], first[0], references[i])

    block_size = 3
    num_blocks, tables = _tables(prompts, new_tokens, block_size, seed=7)
    harness = PagedHarness(model, num_blocks=num_blocks, block_size=block_size)
    generated, first = harness.generate(prompts, new_tokens, tables[: len(prompts)], prefill_chunk=5)
    for i in range(len(prompts)):
        _assert_same(f"prompt {i} batched, chunked prefill", generated[i], first[i], references[i])

    # A prefix-cache hit: a new sequence of the longest prompt reuses the full prompt blocks
    # the batch above filled for it and computes only the rest.
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    prompt = prompts[longest]
    cached_blocks = (len(prompt) - 1) // block_size
    assert cached_blocks > 0, "the longest prompt must fill at least one block"
    table = tables[longest][:cached_blocks] + tables[len(prompts)][cached_blocks:]
    context = cached_blocks * block_size
    tokens, first_logits = list(prompt), None
    chunk = (prompt[context:], context, table)
    generated = []
    while len(generated) < new_tokens:
        logits = harness.step([chunk])[0]
        if first_logits is None:
            first_logits = logits
        token = int(np.argmax(logits))
        generated.append(token)
        tokens.append(token)
        chunk = ([token], len(tokens) - 1, table)
    _assert_same(
        f"prompt {longest} on a prefix-cache hit of {context} tokens", generated, first_logits, references[longest]
    )


def check_engine(path: str, prompts: list[list[int]], new_tokens: int, references) -> None:
    """The engine gives transformers' tokens for each prompt alone, all of them batched, in
    5-token prefill chunks, on prefix-cache hits and after preemption."""
    from fastdeploy_core.config import EngineArgs
    from fastdeploy_core.engine.engine_core import EngineCore
    from fastdeploy_core.engine.outputs import EngineCoreRequest
    from fastdeploy_core.engine.sampling_params import SamplingParams

    longest = max(len(p) for p in prompts) + new_tokens

    def core(**settings) -> EngineCore:
        args = {"model": path, "max_model_len": longest + 4, "block_size": 4, "num_gpu_blocks_override": 256}
        args.update(settings)
        return EngineCore(EngineArgs.create(**args))

    def run(engine: EngineCore, indices: list[int]) -> dict:
        greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        for i in indices:
            engine.add_request(EngineCoreRequest(f"r{i}", prompts[i], greedy))
        outs: dict = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs.setdefault(out.request_id, []).append(out)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "KV blocks leaked"
        return outs

    def assert_tokens(outs: dict, what: str) -> None:
        for rid, chunks in outs.items():
            i = int(rid[1:])
            got = [t for o in chunks for t in o.new_token_ids]
            assert got == references[i][1], f"engine, {what}, prompt {i}: {got}, transformers {references[i][1]}"

    engine = core()
    for i in range(len(prompts)):
        assert_tokens(run(engine, [i]), "alone")
    # The same engine again: every prompt's full blocks are in the prefix cache now.
    hits_before = engine.get_stats()["prefix_cache_hit_tokens"]
    assert_tokens(run(engine, list(range(len(prompts)))), "batched on prefix-cache hits")
    assert engine.get_stats()["prefix_cache_hit_tokens"] > hits_before, "no prefix-cache hit happened"
    del engine
    assert_tokens(run(core(max_num_batched_tokens=5), list(range(len(prompts)))), "batched, 5-token prefill chunks")
    # Blocks for one longest sequence only: the others wait or are preempted and recomputed.
    tight = core(num_gpu_blocks_override=-(-longest // 4) + 1, max_model_len=longest)
    assert_tokens(run(tight, list(range(len(prompts)))), "with preemption")
    assert tight.get_stats()["num_preemptions"] > 0, "nothing was preempted"
