"""The project's tokenizer: HF ``tokenizers`` plus special tokens and a chat template."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer as _HFTokenizer

from fastdeploy_core.errors import InvalidRequestError
from fastdeploy_core.tokenizer.chat_template import DEFAULT_MAX_CHARS, render_chat_template

_SURROGATE = re.compile("[\ud800-\udfff]")


class Tokenizer:
    """Encode/decode text and render chat prompts for one model.

    Built by :func:`fastdeploy_core.tokenizer.load_tokenizer` from an HF directory
    (tokenizer.json) or from GGUF metadata.

    Args:
        backend: the ``tokenizers.Tokenizer`` doing the work.
        special_tokens: role -> token text, e.g. ``{"bos_token": "<s>", "eos_token": "</s>"}``.
        chat_template: jinja2 source of the default chat template, if the model has one.
        add_bos_token: whether ``encode(..., add_special_tokens=True)`` prepends BOS when the
            backend's own post-processor does not.
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        special_tokens: dict[str, str | None] | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        eos_token_ids: Sequence[int] | None = None,
    ):
        self.backend = backend
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self._extra_eos_ids = list(eos_token_ids or [])
        self._added_ids = sorted(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )

    # ---- ids of special tokens -------------------------------------------------------------
    def _id_of(self, role: str) -> int | None:
        token = self.special_tokens.get(role)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        token_id = self._id_of("eos_token")
        if token_id is None and self._extra_eos_ids:
            return self._extra_eos_ids[0]
        return token_id

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation (tokenizer eos plus generation_config eos ids)."""
        ids = [] if self._id_of("eos_token") is None else [self._id_of("eos_token")]
        return ids + [i for i in self._extra_eos_ids if i not in ids]

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of("pad_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        ids = set(self._added_ids)
        for role in self.special_tokens:
            token_id = self._id_of(role)
            if token_id is not None:
                ids.add(token_id)
        return sorted(ids)

    # ---- text <-> ids ----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` BOS is added as the model expects."""
        try:
            # encode_batch releases the GIL while it works (encode does not), so a long text
            # tokenized in a worker thread leaves the server's event loop running.
            ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:
            if isinstance(text, str) and _SURROGATE.search(text):
                raise InvalidRequestError(
                    "text holds a lone UTF-16 surrogate (e.g. \\ud800 without its pair); send valid Unicode"
                ) from None
            raise
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ---- chat ------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        max_chars: int = DEFAULT_MAX_CHARS,
        **template_kwargs,
    ) -> str:
        """The prompt text for ``messages``, rendered with the model's (or the given) template.

        ``template_kwargs`` (e.g. ``tools``, ``enable_thinking``) are passed to the template;
        rendering stops past ``max_chars`` characters (see :func:`render_chat_template`).
        """
        template = chat_template or self.chat_template
        if template is None:
            raise InvalidRequestError(
                "this model has no chat template; send a completion request or pass chat_template"
            )
        variables = {role: token for role, token in self.special_tokens.items()}
        variables.update(template_kwargs)
        return render_chat_template(
            template, messages, add_generation_prompt=add_generation_prompt, max_chars=max_chars, **variables
        )
