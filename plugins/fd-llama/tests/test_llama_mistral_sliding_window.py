"""Mistral with sliding-window attention (served by fd-llama): the same tokens as transformers.

A tiny random ``MistralForCausalLM`` with ``sliding_window=6`` generates far past the window, so
every decode step and most prompt tokens attend to a truncated context. Checked through the
reference ops and through the cpu ops table (C++ attention for short query runs, the reference
attention for the 20-token prompt), with and without chunked prefill.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import pytest
import torch
from fd_llama.llama import LlamaForCausalLM
from transformers import MistralConfig, MistralForCausalLM

from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.loader import load_model_weights, resolve_model_source
from fastdeploy_core.plugins import load_plugins
from fastdeploy_core.builtin.cpu.ops import CpuOps
from fastdeploy_core.testing.paged_harness import PagedHarness
from tests.support.reference import hf_greedy
from test_llama_tiny_configs import BASE

# The tiny Llama sizes of the Llama config tests, with Mistral's window.
CONFIG = {**BASE, "max_position_embeddings": 128, "sliding_window": 6, "tie_word_embeddings": False}
PROMPTS = [
    [1, 5, 17, 33, 8, 60, 42, 11, 9],
    [1, 90, 3],
    [1, 7, 7, 7, 12, 55, 81, 23, 4, 19, 66, 30, 31, 32, 33, 34, 35, 36, 37, 38],
]
NEW_TOKENS = 14


pytestmark = pytest.mark.usefixtures("restore_ops")  # tests install ops tables (tests/conftest.py)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(321)
    hf_model = MistralForCausalLM(MistralConfig(**CONFIG)).eval()
    path = tmp_path_factory.mktemp("mistral")
    hf_model.save_pretrained(path, safe_serialization=True)
    references = [hf_greedy(hf_model, prompt, NEW_TOKENS)[1] for prompt in PROMPTS]
    return str(path), hf_model, references


def _model(path: str):
    source = resolve_model_source(path)
    assert source.architecture == "MistralForCausalLM"
    model = LlamaForCausalLM(source.hf_config)
    model.eval()
    load_model_weights(model, source)
    return model


@pytest.mark.parametrize("ops_cls", [ReferenceOps, CpuOps], ids=["reference", "cpu_kernels"])
@pytest.mark.parametrize("prefill_chunk", [None, 4])
def test_greedy_tokens_match_transformers_past_the_window(checkpoint, ops_cls, prefill_chunk):
    path, _, references = checkpoint
    set_current_ops(ops_cls())
    model = _model(path)
    block_size = 4
    per_seq = -(-(max(map(len, PROMPTS)) + NEW_TOKENS) // block_size)
    order = np.random.default_rng(3).permutation(per_seq * len(PROMPTS) + 1).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(len(PROMPTS))]
    harness = PagedHarness(model, num_blocks=len(order), block_size=block_size)
    generated, _ = harness.generate(PROMPTS, NEW_TOKENS, tables, prefill_chunk=prefill_chunk)
    assert generated == references


def test_the_window_changes_the_tokens(checkpoint):
    """Without the window the same weights give other tokens: the test above can fail."""
    path, _, references = checkpoint
    set_current_ops(ReferenceOps())
    model = _model(path)
    for layer in model.sublayers():
        if hasattr(layer, "sliding_window"):
            layer.sliding_window = None
    harness = PagedHarness(model, num_blocks=40, block_size=4)
    tables = [list(range(i * 10, i * 10 + 10)) for i in range(len(PROMPTS))]
    generated, _ = harness.generate(PROMPTS, NEW_TOKENS, tables)
    assert generated != references


def test_mistral_is_native_under_auto_and_a_bad_window_is_an_error(checkpoint):
    path, _, _ = checkpoint
    source = resolve_model_source(path)
    target, impl, _ = load_plugins().model_provider("MistralForCausalLM", "auto", source.hf_config)
    assert impl == "fastdeploy" and target == "fd_llama.llama:LlamaForCausalLM"
    with pytest.raises(ModelLoadError, match="sliding_window must be a positive"):
        LlamaForCausalLM({**source.hf_config, "sliding_window": -3})
    off = LlamaForCausalLM({**source.hf_config, "use_sliding_window": False})
    assert all(getattr(layer, "sliding_window", None) is None for layer in off.sublayers())
