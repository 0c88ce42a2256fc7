"""Signed JSON for what instances put in Redis.

Redis is a service the user points us at: other processes may be able to write to it (no
password, a shared password, a compromised neighbour). An instance runs what it pops from
Redis, so every value carries an HMAC-SHA256 tag over the Redis key it was written to and its
body, with a key derived from ``--scheduler-secret`` (or ``FD_SCHEDULER_SECRET``, or, failing
both, ``--scheduler-password``) and the topic. A value without a valid tag, or moved to
another key, is dropped before it is decoded; bodies are JSON, never pickle, so even an
authentic but malformed value cannot run code. A stranger who can write to Redis can at most
delete or reorder entries (denial of service), not make an instance run a payload of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from typing import Any

from fastdeploy_core.errors import ConfigError

logger = logging.getLogger("fastdeploy.scheduler")

SECRET_ENV = "FD_SCHEDULER_SECRET"
_LABEL = b"fastdeploy-scheduler/1 "
_TAG_HEX = 64


def signing_secret(config) -> str:
    """The configured secret: ``--scheduler-secret``, else ``FD_SCHEDULER_SECRET``, else the password."""
    for value in (config.scheduler_secret, os.environ.get(SECRET_ENV), config.scheduler_password):
        if value is None:
            continue
        text = value.get_secret_value() if hasattr(value, "get_secret_value") else str(value)
        if text:
            return text
    raise ConfigError(
        "scheduler_secret: --scheduler-name global signs every request and result it puts in Redis, so that a "
        f"process that can write to Redis cannot make an instance run its payloads; set --scheduler-secret or "
        f"env {SECRET_ENV} (the same value on every instance), or --scheduler-password (Redis AUTH, also used "
        "as the signing key)",
        param="scheduler_secret",
    )


class Sealer:
    """Seals and opens values for one topic; counts what it rejected."""

    def __init__(self, secret: str, topic: str):
        self._key = hmac.new(secret.encode(), _LABEL + topic.encode(), hashlib.sha256).digest()
        self.rejected = 0
        self._logged: set[str] = set()

    def __repr__(self) -> str:  # the key must never reach a log line
        return f"Sealer(rejected={self.rejected})"

    def _tag(self, redis_key: str, body: bytes) -> bytes:
        mac = hmac.new(self._key, redis_key.encode() + b"\0", hashlib.sha256)
        mac.update(body)
        return mac.hexdigest().encode()

    def seal(self, redis_key: str, message: dict[str, Any]) -> bytes:
        """The value to write under ``redis_key``."""
        body = json.dumps(message, separators=(",", ":")).encode()
        return self._tag(redis_key, body) + body

    def open(self, redis_key: str, value: bytes) -> dict[str, Any] | None:
        """The message in ``value`` if an instance with our key wrote it under ``redis_key``; else None."""
        if not isinstance(value, bytes) or len(value) <= _TAG_HEX:
            return self._reject(redis_key, "not a signed value")
        tag, body = value[:_TAG_HEX], value[_TAG_HEX:]
        if not hmac.compare_digest(tag, self._tag(redis_key, body)):
            return self._reject(redis_key, "bad signature")
        try:
            message = json.loads(body)
        except ValueError as exc:
            return self._reject(redis_key, f"undecodable body ({exc})")
        if not isinstance(message, dict):
            return self._reject(redis_key, "body is not an object")
        return message

    def _reject(self, redis_key: str, reason: str) -> None:
        self.rejected += 1
        if redis_key not in self._logged and len(self._logged) < 64:
            self._logged.add(redis_key)
            logger.warning(
                "scheduler: dropped a value from Redis key %s (%s); only instances holding the scheduler "
                "secret may write there (further drops on this key are only counted)",
                redis_key,
                reason,
            )
