"""``fastdeploy generate --model-impl fastdeploy`` on a saved tiny Qwen3-MoE directory.

Issue 19 asked that the native implementation serve Qwen3-MoE end to end; this runs the command
line (config, fd-qwen's model, the MoE layer's ``fused_moe``, tokenizer, engine) on a random
checkpoint transformers wrote, and checks the generated tokens against transformers' greedy ones.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from typer.testing import CliRunner

WORDS = ["[UNK]"] + [f"w{i}" for i in range(95)]
PROMPT = "w3 w14 w15 w92 w65 w35 w89 w79"
NEW_TOKENS = 12


def write_checkpoint(path) -> None:
    """Two sparse layers of 4 experts (top-2, renormalised) and a word-level tokenizer over the
    96-token vocabulary, so a raw prompt of words maps to known ids."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.Qwen3MoeConfig(
        vocab_size=len(WORDS),
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.25,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).eval().save_pretrained(str(path))
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"unk_token": "[UNK]"}))


def transformers_greedy(path, prompt_ids: list[int]) -> list[int]:
    import torch
    import transformers

    model = transformers.Qwen3MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.slow
def test_generate_with_the_native_implementation_matches_transformers(tmp_path):
    from fastdeploy_core.cli.main import build_app

    write_checkpoint(tmp_path)
    prompt_ids = [WORDS.index(w) for w in PROMPT.split()]
    args = ["generate", PROMPT, "--raw", "--json", "--max-tokens", str(NEW_TOKENS), "--ignore-eos"]
    engine = ["--model", str(tmp_path), "--model-impl", "fastdeploy", "--max-model-len", "64"]
    result = CliRunner().invoke(build_app(), [*args, *engine, "--num-gpu-blocks-override", "16"])
    assert result.exit_code == 0, result.output
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["num_prompt_tokens"] == len(prompt_ids)
    (completion,) = line["outputs"]
    assert completion["finish_reason"] == "length"
    assert completion["token_ids"] == transformers_greedy(tmp_path, prompt_ids)
    assert completion["text"].split() == [WORDS[t] for t in completion["token_ids"]]
