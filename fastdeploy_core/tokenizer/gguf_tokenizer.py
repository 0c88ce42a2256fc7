"""Rebuild a model's tokenizer from GGUF metadata so that it encodes exactly like llama.cpp.

GPT-2-style (byte-level BPE, ``tokenizer.ggml.model = gpt2``) vocabularies are rebuilt as
``tokenizers`` BPE(vocab, merges) with the pre-tokenizer llama.cpp uses for the file's
``tokenizer.ggml.pre`` value. For SmolLM that is a split of every digit (``\\p{N}``,
isolated) before GPT-2's byte-level regex, which transformers' own GGUF conversion omits.

SentencePiece vocabularies (``tokenizer.ggml.model = llama``: Llama 2, Mistral, TinyLlama)
become a byte-fallback BPE whose merges are recovered from the token scores: llama.cpp
merges the adjacent pair whose merged piece has the highest score first, which is BPE with
merges ranked by that score.

Control tokens (token type 3) become special added tokens, user-defined ones (type 4) plain
added tokens.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.tokenizer.tokenizer import Tokenizer

_NORMAL = 1
_UNKNOWN = 2
_CONTROL = 3
_USER_DEFINED = 4
_BYTE = 6
_SPIECE_SPACE = "\u2581"

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


def _byte_level_backend(reader, path: str, tokens: list[str]) -> _HFTokenizer:
    merges = _field(reader, "tokenizer.ggml.merges") or []
    pre = _field(reader, "tokenizer.ggml.pre") or "default"
    pre_tokenizer, ignore_merges = _pre_tokenizer(pre, path)
    vocab = {token: index for index, token in enumerate(tokens)}
    merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = _HFTokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend


def spm_merges(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece-by-score: every split of a normal piece into two
    vocabulary pieces, ranked by the merged piece's score (highest first)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked = []
    for index, (piece, kind) in enumerate(zip(tokens, token_types)):
        if kind not in (_NORMAL, _USER_DEFINED) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _sentencepiece_backend(reader, tokens: list[str], token_types: list[int]) -> _HFTokenizer:
    scores = [float(x) for x in (_field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens))]
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else ("<unk>" if "<unk>" in tokens else None)
    vocab = {token: index for index, token in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab,
        merges=spm_merges(tokens, scores, token_types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = _HFTokenizer(model)
    add_space_prefix = _field(reader, "tokenizer.ggml.add_space_prefix")
    add_space_prefix = True if add_space_prefix is None else bool(add_space_prefix)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPIECE_SPACE, prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def load_gguf_tokenizer(path: str) -> Tokenizer:
    """The tokenizer stored in the metadata of GGUF file ``path``."""
    from fastdeploy_core.loader.gguf_loader import open_gguf

    reader = open_gguf(path)
    model_kind = _field(reader, "tokenizer.ggml.model")
    if model_kind is None:
        raise ModelLoadError(f"{path} carries no tokenizer (tokenizer.ggml.model is missing)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    token_types = _field(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if model_kind == "gpt2":
        backend = _byte_level_backend(reader, path, tokens)
        special_types = (_CONTROL,)
        default_add_bos = False
    elif model_kind == "llama":
        backend = _sentencepiece_backend(reader, tokens, token_types)
        special_types = (_CONTROL, _UNKNOWN)
        default_add_bos = True  # llama.cpp adds BOS to SentencePiece vocabularies unless told otherwise
    else:
        raise ModelLoadError(
            f"{path}: GGUF tokenizer model {model_kind!r} is not supported (supported: gpt2 byte-level BPE, "
            "llama SentencePiece); use an HF model directory with tokenizer.json instead"
        )
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(token_types) if t in special_types]
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
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    add_bos = default_add_bos if add_bos is None else bool(add_bos)
    return Tokenizer(backend, special_tokens, _field(reader, "tokenizer.chat_template"), add_bos_token=add_bos)
