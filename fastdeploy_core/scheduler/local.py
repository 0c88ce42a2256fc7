"""``--scheduler-name local``: one instance's in-memory queue (the default).

Requests wait here until the engine has room for them (free slots, blocks and step budget, see
:class:`~fastdeploy_core.scheduler.base.Admission`), at most ``--scheduler-max-size`` of them
(-1: no limit; more are refused with 503), and none longer than ``--scheduler-ttl`` seconds
(it then fails with 503 ``scheduler_ttl_expired``). Under ``--policy priority`` the lowest
priority value goes first, as in the engine; else first come, first served.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from fastdeploy_core.scheduler.base import (
    Admission,
    Capacity,
    QueuedRequest,
    RequestExpiredError,
    RequestScheduler,
    SchedulerEvents,
    SchedulerFullError,
    error_dict,
)


class LocalScheduler(RequestScheduler):
    """See the module docstring."""

    name = "local"
    settings = frozenset({"scheduler_name", "scheduler_max_size", "scheduler_ttl"})

    def __init__(self, config):
        super().__init__(config)
        self._queue: list[QueuedRequest] = []
        self._enqueued: dict[str, float] = {}

    def add_request(self, request: QueuedRequest) -> None:
        limit = self.config.scheduler_max_size
        if limit >= 0 and len(self._queue) >= limit:
            raise SchedulerFullError(
                f"the request queue holds {len(self._queue)} requests (--scheduler-max-size {limit}); "
                "retry later, or raise --scheduler-max-size (-1: no limit)"
            )
        self._queue.append(request)
        self._enqueued[request.request_id] = time.monotonic()
        if self.config.policy == "priority":
            self._queue.sort(key=lambda r: (r.priority, r.arrival_time))

    def get_requests(self, capacity: Capacity) -> list[QueuedRequest]:
        self._expire()
        admission = Admission(capacity)
        taken: list[QueuedRequest] = []
        while self._queue and admission.has_room() and admission.fits(self._queue[0]):
            request = self._queue.pop(0)
            self._enqueued.pop(request.request_id, None)
            admission.take(request)
            taken.append(request)
        return taken

    def _expire(self) -> None:
        ttl = self.config.scheduler_ttl
        now = time.monotonic()
        expired = [r for r in self._queue if now - self._enqueued[r.request_id] > ttl]
        for request in expired:
            self._queue.remove(request)
            self._enqueued.pop(request.request_id, None)
            self._errors.append((request.request_id, error_dict(RequestExpiredError(
                f"request {request.request_id} waited more than --scheduler-ttl {ttl} s for the engine and was "
                "dropped; retry it, or raise --scheduler-ttl or add capacity"
            ))))

    def put_outputs(self, outputs: list[Any]) -> list[Any]:
        return outputs

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        ids = set(request_ids)
        self._queue = [r for r in self._queue if r.request_id not in ids]
        for rid in ids:
            self._enqueued.pop(rid, None)
        return list(ids)

    def poll(self) -> SchedulerEvents:
        if self._queue:
            self._expire()
        return super().poll()

    def stats(self) -> dict[str, Any]:
        return {"scheduler_queue_depth": len(self._queue)}
