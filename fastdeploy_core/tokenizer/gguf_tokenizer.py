"""Rebuild a model's tokenizer from GGUF metadata so that it encodes exactly like llama.cpp.

GPT-2-style (byte-level BPE) vocabularies are rebuilt as ``tokenizers`` BPE(vocab, merges)
with the pre-tokenizer llama.cpp uses for the file's ``tokenizer.ggml.pre`` value. For
SmolLM that is a split of every digit (``\\p{N}``, isolated) before GPT-2's byte-level
regex, which transformers' own GGUF conversion omits. Control tokens (token type 3) become
special added tokens, user-defined ones (type 4) plain added tokens.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.tokenizer.tokenizer import Tokenizer

_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str, path: str):
    """The pre-tokenizer llama.cpp applies for ``tokenizer.ggml.pre == pre``, plus whether merges are skipped for whole-vocab words."""
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        ), False
    if pre in ("default", "gpt-2", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False), False
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        regex = _LLAMA3_REGEX
    elif pre == "qwen2":
        regex = _QWEN2_REGEX
    else:
        raise ModelLoadError(
            f"{path}: GGUF tokenizer pre-tokenizer {pre!r} is not supported (supported: smollm, starcoder, "
            "gpt-2, llama-bpe, qwen2); use an HF model directory with tokenizer.json instead"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    ), pre in ("llama-bpe", "llama3", "llama-v3")


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def load_gguf_tokenizer(path: str) -> Tokenizer:
    """The tokenizer stored in the metadata of GGUF file ``path``."""
    from fastdeploy_core.loader.gguf_loader import open_gguf

    reader = open_gguf(path)
    model_kind = _field(reader, "tokenizer.ggml.model")
    if model_kind is None:
        raise ModelLoadError(f"{path} carries no tokenizer (tokenizer.ggml.model is missing)")
    if model_kind != "gpt2":
        raise ModelLoadError(
            f"{path}: GGUF tokenizer model {model_kind!r} is not supported yet (only byte-level BPE, 'gpt2'); "
            "use an HF model directory with tokenizer.json instead"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges") or []
    token_types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = _field(reader, "tokenizer.ggml.pre") or "default"
    pre_tokenizer, ignore_merges = _pre_tokenizer(pre, path)

    vocab = {token: index for index, token in enumerate(tokens)}
    merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = _HFTokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(token_types) if t == _CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(token_types) if t == _USER_DEFINED]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)

    def token_of(key: str) -> str | None:
        token_id = _field(reader, key)
        return tokens[int(token_id)] if token_id is not None and 0 <= int(token_id) < len(tokens) else None

    special_tokens = {
        "bos_token": token_of("tokenizer.ggml.bos_token_id"),
        "eos_token": token_of("tokenizer.ggml.eos_token_id"),
        "unk_token": token_of("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_of("tokenizer.ggml.padding_token_id"),
    }
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token") or False)
    return Tokenizer(backend, special_tokens, _field(reader, "tokenizer.chat_template"), add_bos_token=add_bos)
