"""API-key check for the ``/v1`` routes (``--api-key``, repeatable, or env ``FD_API_KEY``).

Keys are compared in constant time; the answer to a missing and to a wrong key is the same 401
so that a caller learns nothing about which keys exist.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable

from fastapi import Request

from fastdeploy_core.entrypoints.openai.errors import unauthorized


def collect_api_keys(flag_values: Iterable[str] | None) -> list[str]:
    """Keys from the flags plus ``FD_API_KEY`` (comma-separated), without blanks or repeats."""
    keys: list[str] = []
    for key in list(flag_values or []) + os.environ.get("FD_API_KEY", "").split(","):
        key = key.strip()
        if key and key not in keys:
            keys.append(key)
    return keys


class APIKeyChecker:
    """A FastAPI dependency: raises 401 unless ``Authorization: Bearer <key>`` holds a valid key."""

    def __init__(self, keys: Iterable[str]):
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, header: str | None) -> None:
        if not self._keys:
            return
        if not header:
            raise unauthorized("missing API key: send the header `Authorization: Bearer <key>`")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        if not any(hmac.compare_digest(given, key) for key in self._keys):
            raise unauthorized("invalid API key")

    async def __call__(self, request: Request) -> None:
        self.check(request.headers.get("authorization"))
