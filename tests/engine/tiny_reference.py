"""What the tiny-Llama dtype tests share: their prompts, transformers' greedy reference (tokens and
the log-softmax rows that chose them) and a run of the prompts through an engine core."""

from __future__ import annotations

import numpy as np

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.engine.engine_core import EngineCore
from fastdeploy_core.engine.outputs import EngineCoreRequest
from fastdeploy_core.engine.sampling_params import SamplingParams

PROMPTS = [
    [5, 9, 17, 33, 2, 7, 100, 64, 3],
    [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110],
    [1],
    [12, 12, 12, 12, 30],
]


def greedy_reference(model, prompt: list[int], max_new: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens for ``prompt`` and the log-softmax rows that chose them."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        new = out[0, len(prompt) :].tolist()
        logits = model(out).logits[0].double()
    rows = torch.log_softmax(logits, dim=-1).numpy()[len(prompt) - 1 : len(prompt) - 1 + max_new]
    return new, rows


def engine_core(path: str, **kw) -> EngineCore:
    """An engine core on ``path`` sized for the tests' prompts (4-token blocks, 256 of them)."""
    settings = {"model": path, "max_model_len": 128, "block_size": 4, "num_gpu_blocks_override": 256, **kw}
    return EngineCore(EngineArgs.create(**settings))


def run_prompts(core: EngineCore, max_new: int, prompts: list[list[int]] = PROMPTS) -> dict:
    """Greedy ``max_new`` tokens (eos ignored, logprobs 1) for each prompt: request id -> outputs."""
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
    outs: dict = {}
    while core.has_unfinished_requests():
        for out in core.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def logprob_gaps(outs: dict, reference: list, float32: list) -> tuple[float, float]:
    """Assert each prompt's tokens equal ``reference``'s; return the largest gap between the
    engine's chosen-token logprobs and the reference's, and between float32's and the
    reference's (over the tokens float32 chose alike so far). ``reference`` / ``float32``: a
    :func:`greedy_reference` per prompt."""
    engine_gap = f32_gap = 0.0
    for i in range(len(reference)):
        got = [t for o in outs[f"r{i}"] for t in o.new_token_ids]
        ref_tokens, ref_rows = reference[i]
        assert got == ref_tokens, f"prompt {i}"
        lps = [lp for o in outs[f"r{i}"] for lp in o.new_logprobs]
        for k, lp in enumerate(lps):
            engine_gap = max(engine_gap, abs(lp[got[k]] - ref_rows[k][got[k]]))
            if float32[i][0][: k + 1] == got[: k + 1]:  # the float32 model chose the same tokens so far
                f32_gap = max(f32_gap, abs(float32[i][1][k][got[k]] - ref_rows[k][got[k]]))
    return engine_gap, f32_gap
