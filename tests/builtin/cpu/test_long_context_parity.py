"""Greedy tokens at long context: the engine on the cpu device's kernels against transformers.

A tiny random Llama with a 4,096-position context (saved by transformers as safetensors) gets a
2,300-token prompt: alone (one prompt step, then decodes over 2,300+ keys), and beside a short
request with a 512-token step budget (the prompt in chunks deep into its own context, mixed
with the other request's decodes). Each must give transformers' greedy tokens and, through
the paged harness, its last-position logits.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
fd_llama = pytest.importorskip("fd_llama.llama")

from fastdeploy_core.testing.model_parity import LOGITS_ATOL, LOGITS_RTOL
from tests.support.reference import hf_greedy

CONFIG = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.25,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
LONG, SHORT, NEW_TOKENS = 2300, 40, 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(2026)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    path = tmp_path_factory.mktemp("long_llama")
    model.save_pretrained(path, safe_serialization=True)
    rng = np.random.default_rng(3)
    prompts = [[1] + rng.integers(3, 97, size=n - 1).tolist() for n in (LONG, SHORT)]
    references = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    return str(path), prompts, references


def _engine_tokens(path: str, prompts: list[list[int]], **settings) -> dict[int, list[int]]:
    from fastdeploy_core.config import EngineArgs
    from fastdeploy_core.engine.engine_core import EngineCore
    from fastdeploy_core.engine.outputs import EngineCoreRequest
    from fastdeploy_core.engine.sampling_params import SamplingParams

    args = {"model": path, "max_model_len": 4096, "block_size": 16, "num_gpu_blocks_override": 320}
    engine = EngineCore(EngineArgs.create(**{**args, **settings}))
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineCoreRequest(f"r{i}", prompt, greedy))
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(int(out.request_id[1:]), []).extend(out.new_token_ids)
    return tokens


def test_long_prompt_alone_and_chunked_beside_a_decode_match_transformers(checkpoint, cpu_kernels):
    path, prompts, references = checkpoint
    alone = _engine_tokens(path, prompts[:1], max_num_batched_tokens=4096)
    assert alone[0] == references[0][1]
    mixed = _engine_tokens(path, [prompts[1], prompts[0]], max_num_batched_tokens=512)
    assert mixed[0] == references[1][1]
    assert mixed[1] == references[0][1]


def test_long_prompt_logits_on_the_cpu_ops_match_transformers(checkpoint, cpu_kernels):
    """The last-position logits after the 2,300-token prompt, computed in 700-token chunks over
    scrambled blocks by the cpu ops table (its attention kernel over 700 queries x 2,300 keys)."""
    from fastdeploy_core.builtin.cpu.ops import CpuOps
    from fastdeploy_core.devices.current import set_current_ops
    from fastdeploy_core.loader import load_model_weights, resolve_model_source
    from fastdeploy_core.testing.paged_harness import PagedHarness

    path, prompts, references = checkpoint
    set_current_ops(CpuOps())
    source = resolve_model_source(path)
    model = fd_llama.LlamaForCausalLM(source.hf_config)
    model.eval()
    load_model_weights(model, source)
    blocks = -(-(LONG + NEW_TOKENS) // 16)
    table = np.random.default_rng(5).permutation(blocks + 1)[:blocks].tolist()
    harness = PagedHarness(model, num_blocks=blocks + 1, block_size=16)
    generated, first = harness.generate([prompts[0]], NEW_TOKENS, [table], prefill_chunk=700)
    np.testing.assert_allclose(first[0], references[0][0], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    assert generated[0] == references[0][1]
