"""What the speculative-decoding engine tests share: tiny random Llamas, the prompts, engine
cores built with or without a speculative config, and a run to the end that checks every KV
block (the target's and a draft model's own) came back."""

from __future__ import annotations

import pytest

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.engine.engine_core import EngineCore
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.spec_decode.draft_model import DraftModelProposer
from fastdeploy_core.testing.engine_run import run_to_end

PROMPTS = [
    [5, 9, 17, 33, 2, 7, 100, 64, 3, 5, 9, 17, 33, 2],
    [5, 9, 17, 33, 2, 7, 100, 64, 3, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
    [1],
    [90, 91, 92, 93, 94, 95, 96, 97, 90, 91, 92, 93, 94, 95, 96, 97, 90, 91],
    [12, 12, 12, 12, 30],
]


def save_tiny_llama(path: str, seed: int, vocab: int = 128, hidden: int = 64, layers: int = 2) -> str:
    """A random HF Llama checkpoint (no special tokens) written to ``path``."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_core(path: str, spec: dict | None, **kw) -> EngineCore:
    settings = {"model": path, "max_model_len": 96, "block_size": 4, "num_gpu_blocks_override": 256}
    settings.update(kw)
    if spec:
        settings["speculative_config"] = spec
    return EngineCore(EngineArgs.create(**settings))


def assert_draft_cache_empty(core: EngineCore) -> None:
    proposer = core.proposer
    if isinstance(proposer, DraftModelProposer):
        assert proposer.num_free_blocks == proposer.num_blocks, "draft KV blocks leaked"
        assert not proposer._states


def run(core: EngineCore, requests) -> dict:
    """Submit ``(request id, prompt, params)`` and step to the end: {(id, index): token ids}."""
    outs = run_to_end(core, requests, key=lambda out: (out.request_id, out.index))
    assert_draft_cache_empty(core)
    return outs


def greedy(max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def batch() -> list:
    """Greedy requests that speculate, beside sampled, penalised, logprob and n=3 ones."""
    reqs = [(f"g{i}", p, greedy()) for i, p in enumerate(PROMPTS)]
    reqs.append(("hot", PROMPTS[0], SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=30)))
    reqs.append(("pen", PROMPTS[3], greedy(repetition_penalty=1.3)))
    reqs.append(("lp", PROMPTS[1], greedy(logprobs=2, max_tokens=10)))
    reqs.append(("n3", PROMPTS[4], SamplingParams(temperature=0, n=3, max_tokens=30, ignore_eos=True)))
    return reqs
