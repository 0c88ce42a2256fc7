"""The native Llama model on the real default GGUF equals transformers' float32 reference."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import pytest

from fastdeploy_core.testing.paged_harness import PagedHarness
from tests.support.reference import NUM_GREEDY_TOKENS, paddle_smollm2, transformers_smollm2_reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference():
    return transformers_smollm2_reference()


@pytest.fixture(scope="module")
def model():
    return paddle_smollm2()


def test_first_step_logits_match_transformers(reference, model):
    harness = PagedHarness(model, num_blocks=4, block_size=64)
    logits = harness.step([(reference["ids"].tolist(), 0, [2])])[0]
    assert logits.dtype == np.float32 and logits.shape == reference["logits"].shape
    assert np.abs(logits - reference["logits"]).max() < 1e-3
    assert int(np.argmax(logits)) == int(reference["generated"][0])


def test_64_greedy_tokens_match_transformers(reference, model):
    harness = PagedHarness(model, num_blocks=8, block_size=64)
    generated, first = harness.generate([reference["ids"].tolist()], NUM_GREEDY_TOKENS, block_tables=[[5, 3]])
    assert generated[0] == reference["generated"].tolist()
    assert np.abs(first[0] - reference["logits"]).max() < 1e-3


def test_chunked_prefill_small_blocks_in_a_batch_match_transformers(reference, model):
    """Prompt prefilled in 10-token chunks over scattered 16-token blocks, next to a second copy
    prefilled at once: both sequences must produce the reference tokens."""
    prompt = reference["ids"].tolist()
    harness = PagedHarness(model, num_blocks=16, block_size=16)
    steps = 20
    generated, _ = harness.generate(
        [prompt, prompt], steps, block_tables=[[9, 2, 14, 5, 0], [1, 11, 7, 3, 12]], prefill_chunk=10
    )
    assert generated[0] == reference["generated"][:steps].tolist()
    assert generated[1] == reference["generated"][:steps].tolist()
