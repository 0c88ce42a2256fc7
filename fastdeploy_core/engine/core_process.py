"""The engine core in its own process, driven over one pyzmq DEALER socket on 127.0.0.1.

The API process binds the socket (a ROUTER on ``--engine-worker-queue-port``, or a free port, so
the port it picked is really free) and starts this process, which connects back. Every frame in
both directions is sealed with the launch's secret and checked before it is decoded (see
:mod:`fastdeploy_core.engine.link`); bodies are JSON, never pickle. Messages are tuples:

API -> core: ``("add", EngineCoreRequest)``, ``("abort", [request_id, ...])``, ``("shutdown",)``
core -> API: ``("ready", info)``, ``("startup_failed", error)``, ``("outputs", [EngineCoreOutput], stats)``,
``("stats", stats)``, ``("request_error", request_id, error)``, ``("dead", error)``,
``("scheduler_status", {"available": bool, "reason": str})``

where ``error`` is a dict ``{message, type, status, param, code}`` (typed errors keep their
HTTP status across the process boundary). Inputs are drained between steps, so an abort frees
the request's KV blocks before the next step runs.

Requests do not go to the engine directly: they enter the request-level scheduler
(``--scheduler-name``, :mod:`fastdeploy_core.scheduler`), which hands the engine, before each
step, the ones it has room for (its own, or with ``global`` ones taken from other instances),
routes each step's outputs (to this API process, or to the instance a stolen request came
from) and reports outputs, errors and aborts from elsewhere. This process binds nothing: the only socket
it has is the one it connects to the API process.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

from fastdeploy_core.scheduler.base import error_dict as error_payload

logger = logging.getLogger("fastdeploy.engine_core")

#: How long the idle loop sleeps in poll(); bounds how late a shutdown or parent death is seen.
IDLE_POLL_MS = 100


def run_engine_core(
    engine_args: dict[str, Any], address: str, secret: bytes, parent_pid: int, log_level: int = logging.INFO,
    bind_host: str = "127.0.0.1",
) -> None:
    """Process entry point: build the engine, then serve requests until told to stop.

    ``engine_args`` is ``EngineArgs.flat()``; ``secret`` authenticates every frame on the link
    (it is this launch's, from the API process); ``parent_pid`` lets the core exit on its own when the
    API process disappears without a goodbye (SIGKILL), so no core is ever orphaned.
    ``bind_host`` is the server's ``--host``: a prefill instance binds its KV channel there.
    """
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s [engine-core] %(message)s", stream=sys.stderr
    )
    # Ctrl-C reaches the whole process group; the API process decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stopping = {"flag": False}

    def _on_term(signum, frame):
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, _on_term)

    import zmq

    from fastdeploy_core.engine.link import LinkEnd

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    try:
        _serve(_CoreLink(sock, LinkEnd(secret, "core"), address), engine_args, parent_pid, stopping, bind_host)
    finally:
        sock.close()
        ctx.term()


class _CoreLink:
    """The core's end of the socket: sends sealed messages, receives only authentic ones."""

    def __init__(self, sock: Any, link: Any, address: str):
        self.sock = sock
        self.link = link
        self.address = address

    def send(self, msg: tuple) -> None:
        self.sock.send_multipart(self.link.seal(msg))

    def recv(self) -> tuple | None:
        """The next message, or None if the frame was not the API process's (it is dropped)."""
        return self.link.open(self.sock.recv_multipart(), peer=f"the API socket {self.address}")


def _serve(link: _CoreLink, engine_args: dict[str, Any], parent_pid: int, stopping: dict[str, bool],
           bind_host: str = "127.0.0.1") -> None:
    import zmq

    pd = None
    try:
        from fastdeploy_core.config import EngineArgs
        from fastdeploy_core.disaggregation import make_connector
        from fastdeploy_core.engine.engine_core import EngineCore
        from fastdeploy_core.scheduler import scheduler_class

        args = EngineArgs.create(**engine_args)
        scheduler_cls = scheduler_class(args.scheduler.scheduler_name)
        engine = EngineCore(args)
        scheduler = scheduler_cls(args.scheduler)
        pd = make_connector(engine, args, bind_host)
        scheduler.start()
    except Exception as exc:  # noqa: BLE001 - reported to the API process, which exits with it
        logger.error("engine core failed to start: %s", getattr(exc, "message", None) or exc)
        logger.debug("%s", traceback.format_exc())
        link.send(("startup_failed", error_payload(exc)))
        return
    try:
        _loop(link, engine, scheduler, parent_pid, stopping, zmq, pd)
    finally:
        scheduler.stop()
        if pd is not None:
            pd.close()


def _stats(engine: Any, scheduler: Any, pd: Any = None) -> dict[str, Any]:
    """The engine's statistics plus the scheduler's (and the prefill/decode connector's);
    requests queued in the scheduler are waiting too."""
    stats = engine.get_stats()
    extra = scheduler.stats()
    stats.update(extra)
    if pd is not None:
        stats.update(pd.stats())
    stats["num_requests_waiting"] += int(extra.get("scheduler_queue_depth", 0))
    return stats


def _loop(link: _CoreLink, engine: Any, scheduler: Any, parent_pid: int, stopping: dict[str, bool], zmq: Any,
          pd: Any = None) -> None:
    from fastdeploy_core.engine.engine_core import validate_prompt
    from fastdeploy_core.engine.link import _output_from_wire
    from fastdeploy_core.engine.outputs import EngineCoreRequest
    from fastdeploy_core.scheduler.base import QueuedRequest

    link.send(("ready", _ready_info(engine, scheduler, pd)))
    logger.info("engine core ready (pid %d), request scheduler %r", os.getpid(), scheduler.name)
    poller = zmq.Poller()
    poller.register(link.sock, zmq.POLLIN)
    if pd is not None:
        pd.attach(poller)  # its sockets wake the idle wait too
    stats_dirty = False
    # The scheduler's counters as last seen: they also change without an event of this loop (a
    # peer steals from our queue, which we see as a shorter queue at our next pop), and an idle
    # instance must not keep showing the depth of its last busy step.
    scheduler_stats: dict[str, Any] = {}
    last_parent_check = time.monotonic()

    while not stopping["flag"]:
        busy = engine.has_unfinished_requests()
        timeout = 0 if busy else min(IDLE_POLL_MS, scheduler.idle_wait_ms)
        # Drain every pending input before the next step: adds join the queue, aborts free blocks.
        while dict(poller.poll(timeout)).get(link.sock):
            timeout = 0
            msg = link.recv()
            if msg is None:
                continue
            kind = msg[0]
            if kind == "add":
                request = msg[1]
                try:
                    validate_prompt(request.prompt_token_ids, request.sampling_params, engine.max_model_len,
                                    engine.vocab_size)
                    scheduler.add_request(QueuedRequest.from_payload(request.to_dict()))
                except Exception as exc:  # noqa: BLE001 - a bad request must not kill the core
                    link.send(("request_error", request.request_id, error_payload(exc)))
            elif kind == "abort":
                if pd is not None:
                    pd.abort(list(msg[1]))
                engine.abort_requests(scheduler.abort(list(msg[1])))
            elif kind == "shutdown":
                stopping["flag"] = True
                break
            stats_dirty = True
        if stopping["flag"]:
            break

        now = time.monotonic()
        if now - last_parent_check > IDLE_POLL_MS / 1000:
            last_parent_check = now
            if os.getppid() != parent_pid:
                logger.error("API process %d is gone; engine core exits", parent_pid)
                return

        if pd is not None:
            pd.service()
            pd_outputs, pd_errors = pd.take()
            if pd_outputs:
                link.send(("outputs", scheduler.put_outputs(pd_outputs), _stats(engine, scheduler, pd)))
            for request_id, error in pd_errors:
                link.send(("request_error", request_id, error))
            if pd.dirty or pd_errors:  # a transfer started or ended: /metrics shows it before the next step
                pd.dirty = False
                link.send(("stats", _stats(engine, scheduler, pd)))

        events = scheduler.poll()
        if events:
            if events.aborts:
                engine.abort_requests(events.aborts)
            if events.outputs:
                link.send(("outputs", [_output_from_wire(o) for o in events.outputs], _stats(engine, scheduler, pd)))
            for request_id, error in events.errors:
                link.send(("request_error", request_id, error))
            if events.available is not None:
                link.send(("scheduler_status", {"available": events.available, "reason": events.reason}))
            stats_dirty = True
        for queued in scheduler.get_requests(engine.capacity()):
            try:
                request = EngineCoreRequest.from_dict(queued.payload)
                if pd is not None and request.disaggregate is not None and pd.splits(request):
                    pd.start(request)  # a decode instance: the paired prefill instance computes the prompt
                else:
                    if pd is not None and request.disaggregate is not None:
                        pd.served_whole += 1
                    engine.add_request(request)
            except Exception as exc:  # noqa: BLE001 - refused here; its client hears why
                scheduler.fail(queued, error_payload(exc))
            stats_dirty = True
        current = scheduler.stats()
        if current != scheduler_stats:
            scheduler_stats, stats_dirty = current, True

        if engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - fatal: report why, then exit
                logger.error("engine step failed, engine core stops:\n%s", traceback.format_exc())
                link.send(("dead", error_payload(exc)))
                raise SystemExit(1) from None
            if pd is not None:
                outputs = pd.after_step(outputs)
            link.send(("outputs", scheduler.put_outputs(outputs), _stats(engine, scheduler, pd)))
            stats_dirty = False
        elif stats_dirty:
            link.send(("stats", _stats(engine, scheduler, pd)))
            stats_dirty = False
    logger.info("engine core shutting down")


def _ready_info(engine: Any, scheduler: Any, pd: Any = None) -> dict[str, Any]:
    info: dict[str, Any] = {"max_model_len": engine.max_model_len, "pid": os.getpid(), "scheduler": scheduler.name,
                            "scheduler_instance": getattr(scheduler, "instance", None)}
    try:
        info["config_info"] = engine.config_info()
    except Exception as exc:  # noqa: BLE001 - informative only
        info["config_info"] = {"error": str(exc)}
    info["stats"] = _stats(engine, scheduler, pd)
    return info
