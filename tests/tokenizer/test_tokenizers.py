"""Tokenizers: the GGUF rebuild (llama.cpp-exact) and the HF tokenizer.json path, vs transformers."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from functools import lru_cache

import pytest

from fastdeploy_core.default_model import default_model_path
from fastdeploy_core.errors import InvalidRequestError, ModelLoadError
from fastdeploy_core.loader import resolve_model_source
from fastdeploy_core.tokenizer import Tokenizer, load_tokenizer
from fastdeploy_core.tokenizer.chat_template import render_chat_template
from fastdeploy_core.tokenizer.hf_tokenizer import load_hf_tokenizer

ONE_TURN = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM_AND_USER = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Name a colour of the French flag."},
]
TEXTS = [
    "Hello world!",
    "  leading spaces and trailing  ",
    "def f(x):\n    return x ** 2  # squares\n\n\tTabbed",
    "Ünïcödé, 日本語のテキスト, emoji 🎉👍 and Ελληνικά",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]


@lru_cache(maxsize=1)
def ours() -> Tokenizer:
    return load_tokenizer(resolve_model_source(None))


@lru_cache(maxsize=1)
def transformers_tokenizer():
    from transformers import AutoTokenizer

    folder, name = os.path.split(default_model_path())
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_chat_prompt_encodes_like_transformers():
    ref = transformers_tokenizer()
    prompt = ref.apply_chat_template(ONE_TURN, add_generation_prompt=True, tokenize=False)
    assert ours().encode(prompt) == ref(prompt, add_special_tokens=False)["input_ids"]
    assert ours().encode(prompt)[:3] == [1, 9690, 198]  # <|im_start|> system \n


@pytest.mark.parametrize("messages", [ONE_TURN, SYSTEM_AND_USER], ids=["one_turn", "system_user"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(messages, add_generation_prompt):
    expected = transformers_tokenizer().apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours().apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_agreement_without_digits(text):
    tok = ours()
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert ids == transformers_tokenizer()(text, add_special_tokens=False)["input_ids"]


def test_digits_are_split_individually_like_llama_cpp():
    tok = ours()
    ids = tok.encode("In 2024 we sold 1234567 units.")
    pieces = tok.convert_ids_to_tokens(ids)
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("2024") + list("1234567")
    assert tok.decode(ids) == "In 2024 we sold 1234567 units."


def test_special_tokens_of_smollm2():
    tok = ours()
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.vocab_size == 49152
    assert tok.all_special_ids == list(range(17))
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode([1, 4093, 198, 2]) == "user\n"  # specials skipped by default
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # the GGUF says add_bos_token = false


def test_hf_directory_tokenizer_matches_transformers(tmp_path):
    ref = transformers_tokenizer()
    ref.save_pretrained(tmp_path)
    tok = load_hf_tokenizer(str(tmp_path), {"eos_token_id": [2, 0]})
    for text in TEXTS + ["numbers 12345"]:
        assert tok.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
    assert tok.eos_token_id == 2 and tok.eos_token_ids == [2, 0]
    assert tok.bos_token_id == ref.bos_token_id
    assert tok.apply_chat_template(SYSTEM_AND_USER) == ref.apply_chat_template(
        SYSTEM_AND_USER, add_generation_prompt=True, tokenize=False
    )


def test_hf_directory_without_tokenizer_json_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_hf_tokenizer(str(tmp_path))


def test_template_raise_exception_becomes_invalid_request():
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok"
    with pytest.raises(InvalidRequestError, match="first message must be from the user"):
        ours().apply_chat_template([{"role": "assistant", "content": "x"}], chat_template=template)
    assert ours().apply_chat_template(ONE_TURN, chat_template=template) == "ok"


def test_template_syntax_error_and_sandbox_escape_are_invalid_requests():
    with pytest.raises(InvalidRequestError, match="syntax error"):
        render_chat_template("{% for m in messages %}{{ m ", ONE_TURN)
    with pytest.raises(InvalidRequestError):
        render_chat_template("{{ messages.append({'role': 'x'}) }}", ONE_TURN)  # immutable sandbox
    with pytest.raises(InvalidRequestError):
        render_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", ONE_TURN)


def test_template_helpers_loopcontrols_tojson_and_kwargs():
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
        "|{{ strftime_now('%Y') | length }}|{{ bos_token }}|{{ enable_thinking }}"
    )
    out = ours().apply_chat_template(SYSTEM_AND_USER, chat_template=template, enable_thinking=False)
    assert out == '{"role": "system", "content": "You answer in one word."}|4|<|im_start|>|False'
