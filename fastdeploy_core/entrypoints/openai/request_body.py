"""Reading a JSON request body: size, media type, nesting and Unicode limits, validation off the loop.

Routes declare their pydantic request model as a FastAPI body parameter, so ``/openapi.json``
describes every request. Validating a large body costs real time (a 4 MB list of token ids takes
~0.5 s in pydantic), and FastAPI would do it on the event loop, where it stalls every other
client, ``/health`` included. :class:`GuardedRoute` therefore reads the body itself (413 past
``--max-request-body-bytes``, 415 for anything but JSON), then decodes and validates it in a worker
thread; FastAPI receives the validated model instance, which its own validation passes through
unchanged. Every refusal is a typed error with OpenAI's error shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from email.message import Message
from typing import Any

import anyio.to_thread
import numpy as np
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from fastdeploy_core.entrypoints.openai.errors import body_too_large, unsupported_media_type, validation_to_error
from fastdeploy_core.errors import InvalidRequestError

#: Default of ``--max-request-body-bytes``: a full 128k-token prompt as text or as ids fits with room.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: Deepest JSON nesting a request may have; OpenAI's shapes need fewer than 10 levels.
MAX_JSON_DEPTH = 64

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"?')  # a JSON string, or its unterminated rest: never backtracks
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


def json_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in ``raw`` (brackets inside strings do not count)."""
    steps = _OPEN[np.frombuffer(_STRING.sub(b"", raw), dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def _find_surrogate(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and _SURROGATE.search(key):
            return f"{path}.{key!a}".lstrip(".")
        found = _find_surrogate(item, f"{path}.{key}")
        if found is not None:
            return found.lstrip(".")
    return None


def decode_json(raw: bytes) -> Any:
    """The JSON value of ``raw``; InvalidRequestError when it is not JSON, nests too deeply or holds a
    lone UTF-16 surrogate (text that no tokenizer and no UTF-8 response can carry)."""
    # Fewer opening brackets than the limit, strings included, cannot nest past it: skip the scan.
    depth = 0 if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH else json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise InvalidRequestError(
            f"request body nests arrays/objects {depth} levels deep; at most {MAX_JSON_DEPTH} are allowed",
            code="invalid_json",
        )
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # pragma: no cover - the depth check comes first
        raise InvalidRequestError("request body nests too deeply", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(raw):
        where = _find_surrogate(data, "")
        if where is not None:
            raise InvalidRequestError(
                f"{where or 'request'}: text holds a lone UTF-16 surrogate (e.g. \\ud800 without its pair); "
                "send valid Unicode",
                param=where.split(".")[0] if where else None,
            )
    return data


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """Decode a JSON body and validate it as ``model``; every failure is a 400 InvalidRequestError."""
    data = decode_json(raw) if raw else None
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_to_error(exc) from None


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    message = Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class _ParsedRequest(Request):
    """A request whose body has been read and validated already."""

    def __init__(self, request: Request, raw: bytes, parsed: Any):
        super().__init__(request.scope, request.receive)
        self._raw_body = raw
        self._parsed = parsed

    async def body(self) -> bytes:
        return self._raw_body

    async def json(self) -> Any:
        return self._parsed


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class GuardedRoute(APIRoute):
    """An APIRoute whose JSON body is size-limited, media-type checked and validated in a thread.

    The limit is read from ``app.state.max_request_body_bytes`` (set by the app factory).
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = self._body_model()
        if model is None:
            return handler

        async def guarded(request: Request) -> Response:
            limit = getattr(request.app.state, "max_request_body_bytes", DEFAULT_MAX_BODY_BYTES)
            content_type = request.headers.get("content-type")
            declared = request.headers.get("content-length")
            if declared not in (None, "0") and not _is_json(content_type):
                raise unsupported_media_type(content_type)
            raw = await read_body(request, limit)
            if not raw:
                return await handler(request)  # FastAPI reports the missing body
            if not _is_json(content_type):
                raise unsupported_media_type(content_type)
            parsed = await anyio.to_thread.run_sync(parse_body, model, raw)
            return await handler(_ParsedRequest(request, raw, parsed))

        return guarded

    def _body_model(self) -> type[BaseModel] | None:
        field = self.body_field
        annotation = getattr(getattr(field, "field_info", None), "annotation", None)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return annotation
        return None
