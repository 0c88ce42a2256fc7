"""Build a :class:`Tokenizer` from an HF model directory (tokenizer.json + tokenizer_config.json)."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer as _HFTokenizer

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.tokenizer.tokenizer import Tokenizer

_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


def _chat_template(model_dir: str, config: dict) -> str | None:
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None:
        template = _read_json(os.path.join(model_dir, "chat_template.json")).get("chat_template")
    return template


def load_hf_tokenizer(model_dir: str, generation_config: dict | None = None) -> Tokenizer:
    """The tokenizer of an HF model directory; ModelLoadError when tokenizer.json is missing."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise ModelLoadError(
            f"{model_dir} has no tokenizer.json; only fast (tokenizers) tokenizers are supported - "
            "save the tokenizer with transformers' AutoTokenizer (use_fast=True) into that directory"
        )
    try:
        backend = _HFTokenizer.from_file(path)
    except Exception as exc:
        raise ModelLoadError(f"{path} is not a valid tokenizer.json: {exc}") from None
    config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    special = {role: _token_text(config.get(role)) for role in _ROLES}
    special_map = _read_json(os.path.join(model_dir, "special_tokens_map.json"))
    for role in _ROLES:
        if special[role] is None:
            special[role] = _token_text(special_map.get(role))
    eos_ids = (generation_config or {}).get("eos_token_id")
    eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
    # tokenizer.json's post-processor already adds BOS when the model wants it.
    return Tokenizer(backend, special, _chat_template(model_dir, config), add_bos_token=False, eos_token_ids=eos_ids)
