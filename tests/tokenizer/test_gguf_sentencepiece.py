"""SentencePiece GGUF vocabularies (Llama 2 / Mistral style): our rebuild vs transformers' GGUF tokenizer."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gguf
import numpy as np
import pytest

from fastdeploy_core.tokenizer.gguf_tokenizer import load_gguf_tokenizer, spm_merges

PIECES = [
    "▁", "t", "h", "e", "c", "a", "s", "o", "n", "m", "l", "w", "r", "d", ".", "H",
    "▁t", "he", "at", "▁c", "▁h", "▁s", "▁o", "on", "▁m", "ll", "lo", "wo", "or", "ld",
    "▁the", "▁cat", "▁hat", "▁sat", "▁on", "▁mat", "▁He", "llo", "▁Hello", "▁wor", "▁world", "▁▁",
]  # fmt: skip
TEXTS = ["the cat sat on the mat", "Hello world", "  the  hat.", "ünï 42 ☃", "the</s>cat", "", "x", "the\nhat"]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(PIECES)
    scores = [0.0] * 259 + [-float(i) for i in range(len(PIECES))]
    folder = tmp_path_factory.mktemp("spm")
    writer = gguf.GGUFWriter(str(folder / "spm.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return folder


def test_sentencepiece_gguf_encodes_and_decodes_like_transformers(spm_gguf):
    from transformers import AutoTokenizer

    ours = load_gguf_tokenizer(str(spm_gguf / "spm.gguf"))
    ref = AutoTokenizer.from_pretrained(spm_gguf, gguf_file="spm.gguf")
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=True)
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
    assert ours.encode("the cat", add_special_tokens=True)[0] == 1  # BOS by default for SentencePiece
    assert ours.convert_ids_to_tokens(ours.encode("ü")) == ["▁", "<0xC3>", "<0xBC>"]  # byte fallback


def test_spm_merges_rank_by_merged_piece_score():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    merges = spm_merges(tokens, [0, 0, 0, -2.0, -1.0, -3.0], [1] * 6)
    assert merges == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]
