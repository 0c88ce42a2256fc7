"""The engine core's guided-decoding steps: masks in, sampled tokens back into the matchers.

Kept apart from :mod:`fastdeploy_core.engine.engine_core` so the core's step reads as three
calls: :func:`bitmasks` before the runner (one bitmask per row that samples under a
constraint), :func:`advance` after the scheduler took the sampled tokens, and
:func:`end_failed` for requests whose constraint did not compile (they end with
``finish_reason "abort"``, the reason in the log; the API server checks constraints before it
admits a request, so this is a backstop).
"""

from __future__ import annotations

import logging

import numpy as np

from fastdeploy_core.engine.outputs import EngineCoreOutput
from fastdeploy_core.engine.request import RequestStatus
from fastdeploy_core.engine.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)

#: How long an engine with nothing but compiling grammars waits for one in a step (seconds).
IDLE_WAIT_S = 0.01


def bitmasks(guided, batch: ScheduledBatch) -> list[np.ndarray | None] | None:
    """Per row of ``batch``: the allowed-token bitmask, or None; None when no row has one."""
    rows = []
    for i, (req, _) in enumerate(batch.scheduled):
        rows.append((req.guided, req.output_token_ids) if req.guided is not None and batch.samples(i) else None)
    if not any(rows):
        return None
    return guided.bitmasks(rows)


def advance(batch: ScheduledBatch) -> None:
    """Feed each constrained request's new token to its matcher."""
    for req, _ in batch.scheduled:
        if req.guided is not None and not req.is_finished:
            req.guided.sync(req.output_token_ids)
            if req.guided.error is not None:
                logger.warning("request %s left its grammar: %s", req.request_id, req.guided.error)


def end_failed(core) -> list[EngineCoreOutput]:
    """End the waiting requests whose grammar failed to compile; their final outputs."""
    failed = [r for r in core.scheduler.waiting if r.guided is not None and r.guided.ready and r.guided.failed]
    outputs = []
    for req in core.scheduler.finish_requests([r.request_id for r in failed], RequestStatus.FINISHED_ABORTED):
        logger.error("request %s: its constraint did not compile: %s", req.request_id, req.guided.error)
        core.num_requests_aborted += 1
        core._forget(req)
        outputs.append(
            EngineCoreOutput(request_id=req.parent_id, index=req.index, finished=True, finish_reason="abort")
        )
    return outputs


def wait_for_grammars(core) -> None:
    """Nothing could run: wait a little for a compiling grammar instead of spinning."""
    pending = [r.guided for r in core.scheduler.waiting if r.guided is not None and not r.guided.ready]
    if pending:
        core.guided.wait(pending, IDLE_WAIT_S)
