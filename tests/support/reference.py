"""Shared, computed-once results for the model tests.

The transformers reference (torch CPU, float32) of the default SmolLM2 GGUF costs ~20 s to
load, so its results are computed once per test session and also cached on disk, keyed by
the model file and the library versions. Our own Paddle model is likewise built once.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
NUM_GREEDY_TOKENS = 64


def _cache_dir() -> str:
    root = os.environ.get("FD_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fastdeploy-core-tests")
    os.makedirs(root, exist_ok=True)
    return root


@lru_cache(maxsize=1)
def transformers_smollm2_reference() -> dict:
    """Chat-prompt ids, first-step logits and 64 greedy tokens (eos ignored) from transformers."""
    import torch
    import transformers

    from fastdeploy_core.default_model import default_model_path

    path = default_model_path()
    stat = os.stat(path)
    key_src = json.dumps(
        [path, stat.st_size, stat.st_mtime_ns, torch.__version__, transformers.__version__, CHAT_MESSAGES, NUM_GREEDY_TOKENS]
    )
    cache_file = os.path.join(_cache_dir(), f"smollm2-ref-{hashlib.sha256(key_src.encode()).hexdigest()[:16]}.npz")
    if os.path.isfile(cache_file):
        data = np.load(cache_file)
        return {k: data[k] for k in data.files}

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    prompt = tokenizer.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    logits, generated = hf_greedy(model, ids, NUM_GREEDY_TOKENS, pad_token_id=tokenizer.pad_token_id)
    result = {
        "ids": np.asarray(ids, dtype=np.int64),
        "logits": logits.astype(np.float32),
        "generated": np.asarray(generated, dtype=np.int64),
    }
    np.savez(cache_file + ".tmp.npz", **result)
    os.replace(cache_file + ".tmp.npz", cache_file)
    return result


@lru_cache(maxsize=1)
def paddle_smollm2():
    """Our LlamaForCausalLM with the default GGUF's weights (built once per session)."""
    from fd_llama.llama import LlamaForCausalLM

    from fastdeploy_core.loader import load_model_weights, resolve_model_source

    source = resolve_model_source(None)
    model = LlamaForCausalLM(source.hf_config)
    model.eval()
    load_model_weights(model, source)
    return model


def hf_greedy(model, prompt: list[int], new_tokens: int, pad_token_id: int | None = 0) -> tuple[np.ndarray, list[int]]:
    """A transformers model's last-position logits for ``prompt`` and its ``new_tokens`` greedy
    continuation (eos ignored), as the model tests compare them."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float().numpy()
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_token_id,
        )
    return logits, out[0, len(prompt) :].tolist()
