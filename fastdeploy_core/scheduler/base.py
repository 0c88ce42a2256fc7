"""The request-level scheduler contract: what sits between the API side and the engine core.

The engine core process owns one :class:`RequestScheduler`. Requests the API process sends go
into it (:meth:`~RequestScheduler.add_request`); before every engine step the core asks it for
the requests the engine can take now (:meth:`~RequestScheduler.get_requests`, given the
engine's :class:`Capacity`), so requests the engine cannot run yet stay in the scheduler's
queue, where another instance may take them; after the step the core hands it the outputs
(:meth:`~RequestScheduler.put_outputs`) and forwards to its API process only the ones that
belong to this instance's clients. :meth:`~RequestScheduler.poll` brings what happened
elsewhere: outputs other instances computed for our clients, requests that failed, aborts of
work we run for others, and whether the scheduler can take requests at all.

Why in the engine core process: the admission decision needs the engine's free blocks and
slots of this very moment, and the core's loop already runs between steps; the API process
stays unchanged whatever scheduler runs, and the scheduler never touches an engine object.

Requests and outputs cross the scheduler as plain JSON-able dicts (``payload``) or as objects
with ``request_id``/``finished``/``to_dict()``, so a scheduler that ships them elsewhere (Redis)
never imports the engine and never pickles.

A third-party scheduler is a subclass registered by a plugin::

    @hookimpl
    def register_schedulers(register):
        register("mine", "my_package.scheduler:MyScheduler")
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastdeploy_core.config import SchedulerConfig
from fastdeploy_core.errors import FastDeployError

#: Blocks kept free for each admitted sequence's first generated tokens beyond its prompt.
RESERVED_OUTPUT_BLOCKS = 1


class SchedulerUnavailableError(FastDeployError):
    """The scheduler cannot take or deliver requests now (its store is unreachable)."""

    http_status = 503
    error_type = "service_unavailable"
    code = "scheduler_unavailable"


class SchedulerFullError(FastDeployError):
    """The scheduler's queue holds ``--scheduler-max-size`` requests already."""

    http_status = 503
    error_type = "service_unavailable"
    code = "scheduler_full"


class RequestExpiredError(FastDeployError):
    """A request waited in a scheduler queue longer than ``--scheduler-ttl``."""

    http_status = 503
    error_type = "service_unavailable"
    code = "scheduler_ttl_expired"


class PeerLostError(FastDeployError):
    """The instance that took a request stopped answering before the request finished."""

    http_status = 503
    error_type = "service_unavailable"
    code = "scheduler_peer_lost"


@dataclass(slots=True)
class QueuedRequest:
    """One request as schedulers hold it: the engine request's wire form plus what admission needs."""

    request_id: str
    payload: dict[str, Any]
    num_prompt_tokens: int
    num_choices: int
    arrival_time: float
    priority: int = 0

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> QueuedRequest:
        """Built from ``EngineCoreRequest.to_dict()``."""
        params = payload.get("sampling_params") or {}
        return cls(
            request_id=str(payload["request_id"]),
            payload=payload,
            num_prompt_tokens=len(payload["prompt_token_ids"]),
            num_choices=int(params.get("n") or 1),
            arrival_time=float(payload.get("arrival_time") or 0.0),
            priority=int(payload.get("priority") or 0),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "payload": self.payload,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_choices": self.num_choices,
            "arrival_time": self.arrival_time,
            "priority": self.priority,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QueuedRequest:
        return cls(
            request_id=str(data["request_id"]),
            payload=dict(data["payload"]),
            num_prompt_tokens=int(data["num_prompt_tokens"]),
            num_choices=int(data["num_choices"]),
            arrival_time=float(data["arrival_time"]),
            priority=int(data.get("priority", 0)),
        )


@dataclass(slots=True)
class Capacity:
    """What the engine can take before its next step."""

    free_slots: int  # sequences it may still add (max_num_seqs minus running and waiting)
    free_blocks: int  # KV blocks not held by running or waiting sequences
    block_size: int
    token_budget: int  # prompt tokens one step may compute
    idle: bool  # nothing runs or waits in the engine

    def blocks_for(self, request: QueuedRequest) -> int:
        per_choice = math.ceil(request.num_prompt_tokens / self.block_size) + RESERVED_OUTPUT_BLOCKS
        return per_choice * request.num_choices


class Admission:
    """Counts down a :class:`Capacity` while a scheduler picks requests for one step.

    A request fits while its choices fit the free slots, its blocks (prompt plus
    :data:`RESERVED_OUTPUT_BLOCKS` per choice) the free blocks, and its prompt the step's token
    budget; the first request of an idle engine is taken whatever its prompt length (chunked
    prefill splits it), so a long prompt never waits for a budget it can never meet.
    """

    def __init__(self, capacity: Capacity):
        self.capacity = capacity
        self.slots = capacity.free_slots
        self.blocks = capacity.free_blocks
        self.budget = capacity.token_budget
        self.taken = 0

    def _first(self) -> bool:
        return self.capacity.idle and not self.taken

    def has_room(self) -> bool:
        return self._first() or (self.slots > 0 and self.blocks > 0 and self.budget > 0)

    def fits(self, request: QueuedRequest) -> bool:
        if self._first():
            return True  # the engine's own checks refuse what could never run
        return (
            request.num_choices <= self.slots
            and self.capacity.blocks_for(request) <= self.blocks
            and request.num_prompt_tokens <= self.budget
        )

    def take(self, request: QueuedRequest) -> None:
        self.slots -= request.num_choices
        self.blocks -= self.capacity.blocks_for(request)
        self.budget -= request.num_prompt_tokens
        self.taken += 1


@dataclass
class SchedulerEvents:
    """What :meth:`RequestScheduler.poll` brings back."""

    #: outputs (wire dicts of EngineCoreOutput) of this instance's requests computed elsewhere
    outputs: list[dict[str, Any]] = field(default_factory=list)
    #: (request_id, error payload) of this instance's requests that failed in the scheduler
    errors: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    #: request ids running in this engine that must stop (their client went away)
    aborts: list[str] = field(default_factory=list)
    #: None: unchanged; else the new availability (True: up, False: down with ``reason``)
    available: bool | None = None
    reason: str = ""

    def __bool__(self) -> bool:
        return bool(self.outputs or self.errors or self.aborts or self.available is not None)


def error_dict(exc: BaseException) -> dict[str, Any]:
    """The JSON form of an error that keeps its HTTP mapping (as the engine link carries it)."""
    return {
        "message": getattr(exc, "message", None) or str(exc) or type(exc).__name__,
        "type": getattr(exc, "error_type", "internal_error"),
        "status": int(getattr(exc, "http_status", 500)),
        "param": getattr(exc, "param", None),
        "code": getattr(exc, "code", None),
        "exc_type": type(exc).__name__,
    }


class RequestScheduler(ABC):
    """Base of request-level schedulers (see the module docstring for where it runs).

    Subclasses set :attr:`name` and :attr:`settings` (the ``SchedulerConfig`` fields they read;
    other scheduler settings given with them are named in a warning at startup).
    """

    name: ClassVar[str] = ""
    settings: ClassVar[frozenset[str]] = frozenset({"scheduler_name"})
    #: True: requests the engine cannot start yet wait in this scheduler's queue (bounded by its
    #: ttl), where peers may take them, so the API process hands every request over at once
    #: instead of holding it for a free engine slot (and ``--max-waiting-time`` does not apply).
    holds_waiting_requests: ClassVar[bool] = False

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self._errors: list[tuple[str, dict[str, Any]]] = []

    @classmethod
    def preflight(cls, config: SchedulerConfig) -> None:
        """Check, in the API process before the engine starts, that this scheduler can work
        (a store it needs is reachable); raise a typed error naming the flag to change."""

    @classmethod
    def ignored_settings(cls, config: SchedulerConfig) -> list[str]:
        """Settings given with a value other than their default that this scheduler never reads."""
        ignored = []
        for key, info in type(config).model_fields.items():
            if not key.startswith("scheduler_") or key in cls.settings:
                continue
            if getattr(config, key) != info.default:
                ignored.append(key)
        return ignored

    def start(self) -> None:
        """Connect and announce this instance; called once in the engine core process."""

    def stop(self) -> None:
        """Leave: withdraw what this instance announced; called when the engine core stops."""

    @property
    def available(self) -> bool:
        return True

    @property
    def idle_wait_ms(self) -> int:
        """How long the engine loop may wait for input while it runs nothing."""
        return 100

    @abstractmethod
    def add_request(self, request: QueuedRequest) -> None:
        """Queue a request of this instance's client; typed errors (full, unavailable) reject it."""

    @abstractmethod
    def get_requests(self, capacity: Capacity) -> list[QueuedRequest]:
        """Requests for this engine to start now (its own first, then others' if it steals)."""

    @abstractmethod
    def put_outputs(self, outputs: list[Any]) -> list[Any]:
        """Route one step's outputs; return the ones for this instance's clients."""

    @abstractmethod
    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Forget requests of this instance's clients; return those this engine must abort."""

    def fail(self, request: QueuedRequest, error: dict[str, Any]) -> None:
        """A request handed out by :meth:`get_requests` could not start here (the engine refused it)."""
        self._errors.append((request.request_id, error))

    def poll(self) -> SchedulerEvents:
        """What happened since the last call (see :class:`SchedulerEvents`)."""
        events = SchedulerEvents(errors=self._errors)
        self._errors = []
        return events

    def stats(self) -> dict[str, Any]:
        """Counters for ``/metrics`` (merged into the engine's statistics)."""
        return {}
