"""What the router knows about each instance: what it registered, its load, when it was last heard.

An instance is known by its HTTP address (``host:port``). It re-sends its registration every
few seconds (the heartbeat); one not heard from for ``ttl`` seconds is dropped, and so is one
that failed a request (it comes back with its next heartbeat, if it is alive).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ROLES = ("mixed", "prefill", "decode")


class InstanceInfo(BaseModel):
    """The body of ``POST /register`` (FastDeploy's ``register_info`` fields)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["mixed", "prefill", "decode"]
    host: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)
    metrics_port: int | None = Field(None, ge=1, le=65535)
    #: ``host:port`` of the instance's prefill/decode channel (prefill instances bind it).
    transfer_endpoint: str | None = Field(None, max_length=300)
    protocols: list[str] = Field(default_factory=list, max_length=16)
    tp_size: int = Field(1, ge=1)
    version: str = Field("", max_length=64)
    model: str | None = Field(None, max_length=512)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@dataclass(slots=True)
class Instance:
    """A registered instance and the router's own count of its load."""

    info: InstanceInfo
    last_seen: float
    in_flight: int = 0
    tokens_in_flight: int = 0
    routed: int = 0
    failures: int = 0

    @property
    def key(self) -> str:
        return self.info.address

    def as_dict(self) -> dict:
        return {**self.info.model_dump(), "in_flight": self.in_flight, "tokens_in_flight": self.tokens_in_flight,
                "routed": self.routed, "last_seen_s_ago": round(time.monotonic() - self.last_seen, 3)}


class DuplicateInstanceError(ValueError):
    """A registration for an address already registered under another role."""


@dataclass
class InstanceRegistry:
    """The live instances, by address."""

    ttl: float
    instances: dict[str, Instance] = field(default_factory=dict)
    removed_total: int = 0

    def register(self, info: InstanceInfo) -> bool:
        """Add or refresh ``info``; True when it is new. A new role for a known address is refused."""
        now = time.monotonic()
        known = self.instances.get(info.address)
        if known is not None:
            if known.info.role != info.role:
                raise DuplicateInstanceError(
                    f"{info.address} is already registered as {known.info.role!r}; an address serves one role "
                    "(restart the instance, or wait for the old registration to expire)"
                )
            known.info = info
            known.last_seen = now
            return False
        self.instances[info.address] = Instance(info=info, last_seen=now)
        return True

    def expire(self) -> list[str]:
        """Drop the instances silent for longer than ``ttl``; their addresses."""
        now = time.monotonic()
        gone = [k for k, inst in self.instances.items() if now - inst.last_seen > self.ttl]
        for key in gone:
            self.remove(key)
        return gone

    def remove(self, key: str) -> None:
        if self.instances.pop(key, None) is not None:
            self.removed_total += 1

    def with_role(self, *roles: str) -> list[Instance]:
        self.expire()
        return [inst for inst in self.instances.values() if inst.info.role in roles]

    def counts(self) -> dict[str, int]:
        self.expire()
        out = {role: 0 for role in ROLES}
        for inst in self.instances.values():
            out[inst.info.role] += 1
        return out
