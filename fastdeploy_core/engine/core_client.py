"""The API process's side of the engine core: start it, feed it, stream its outputs back.

:class:`EngineCoreClient` owns the core process and the socket (see
:mod:`fastdeploy_core.engine.core_process` for the messages and
:mod:`fastdeploy_core.engine.link` for how each frame is authenticated).

The socket is a ROUTER bound on ``127.0.0.1:--engine-worker-queue-port`` (a free port when the
flag is unset): the port stays what FastDeploy users know, and because any local process can
connect to it, the socket trusts no connection, only frames. A frame counts only if it carries
this launch's HMAC; replies go only to the connection the last authentic frame came from, so a
stranger that connects neither reaches the engine nor receives a single request. A Unix socket
in a private directory would also keep strangers out, but it would take the port away from the
users who pass it, so the link stays on TCP and relies on the per-frame secret.

:class:`AsyncEngineClient` turns
that into one async stream of :class:`RequestOutput` per request: it runs the
:class:`OutputProcessor` (incremental detokenization, stop strings) in the API process, aborts a
request in the core when a stop string matches or when its consumer goes away, and fails every
open stream with :class:`EngineDeadError` the moment the core process dies.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from fastdeploy_core.engine.core_process import run_engine_core
from fastdeploy_core.engine.link import LinkEnd, new_secret
from fastdeploy_core.errors import ConfigError, EngineDeadError, FastDeployError

logger = logging.getLogger("fastdeploy.engine_client")


class RemoteError(FastDeployError):
    """An error raised in the engine core, rebuilt with its HTTP status, type, param and code."""

    def __init__(self, payload: dict[str, Any]):
        super().__init__(payload["message"], param=payload.get("param"), code=payload.get("code"))
        self.http_status = payload.get("status", 500)
        self.error_type = payload.get("type", "internal_error")
        self.exc_type = payload.get("exc_type")


class EngineCoreClient:
    """Starts the engine core process and talks to it over 127.0.0.1:``port`` (free port if None)."""

    #: Largest frame the socket accepts; a stranger's bigger frame closes its connection before it
    #: is buffered. Real outputs stay far below it (prompt logprobs of a very long prompt: ~100 MB).
    MAX_FRAME_BYTES = 1 << 30

    def __init__(self, engine_args: dict[str, Any], port: int | None = None, log_level: int = logging.INFO,
                 bind_host: str = "127.0.0.1"):
        self.engine_args = engine_args
        self.bind_host = bind_host  # where a prefill instance's core binds its KV channel (--host)
        self.requested_port = port
        self.log_level = log_level
        self.port: int | None = None
        self.process: multiprocessing.process.BaseProcess | None = None
        self.ready_info: dict[str, Any] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._secret = new_secret()
        self._link = LinkEnd(self._secret, "api")
        #: ROUTER id of the core's connection, learnt from its first authentic frame.
        self._peer: bytes | None = None

    @property
    def rejected_frames(self) -> int:
        """Frames dropped because they did not come from this launch's engine core."""
        return self._link.rejected

    def _bind(self) -> str:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # A ROUTER drops what it cannot queue; the core's inputs must never be dropped.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.MAX_FRAME_BYTES)
        try:
            if self.requested_port:
                sock.bind(f"tcp://127.0.0.1:{self.requested_port}")
                self.port = self.requested_port
            else:
                sock.bind("tcp://127.0.0.1:*")
                self.port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        except zmq.ZMQError as exc:
            sock.close()
            raise ConfigError(
                f"engine_worker_queue_port: cannot listen on 127.0.0.1:{self.requested_port} ({exc}); "
                "pick a free port or leave --engine-worker-queue-port unset",
                param="engine_worker_queue_port",
            ) from None
        self._sock = sock
        return f"tcp://127.0.0.1:{self.port}"

    async def start(self, timeout: float = 600.0) -> dict[str, Any]:
        """Spawn the core and wait until its engine is built; raise its error if it fails.

        The request-level scheduler is checked first (its name is registered, a store it needs
        answers), so a wrong ``--scheduler-*`` flag fails in seconds, not after the model loads.
        """
        from fastdeploy_core.config import EngineArgs
        from fastdeploy_core.scheduler import check_scheduler

        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, check_scheduler, EngineArgs.create(**self.engine_args).scheduler)
        address = self._bind()
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(
            target=run_engine_core,
            # The secret travels in the spawn pipe, never on a command line, in the environment or a log.
            args=(self.engine_args, address, self._secret, os.getpid(), self.log_level, self.bind_host),
            name="fastdeploy-engine-core",
            daemon=True,
        )
        self.process.start()
        logger.info("engine core process %d started on %s", self.process.pid, address)
        deadline = time.monotonic() + timeout
        while True:
            if await self._sock.poll(200, zmq.POLLIN):
                msg = await self._recv_authentic()
                if msg is None:
                    continue
                if msg[0] == "ready":
                    self.ready_info = msg[1]
                    return self.ready_info
                if msg[0] == "startup_failed":
                    await self.shutdown()
                    raise RemoteError(msg[1])
                continue
            if not self.process.is_alive():
                code = self.process.exitcode
                await self.shutdown()
                raise EngineDeadError(f"engine core process exited during startup with code {code}; see the log above")
            if time.monotonic() > deadline:
                await self.shutdown()
                raise EngineDeadError(f"engine core did not become ready within {timeout:.0f} s")

    def send(self, msg: tuple) -> None:
        """Seal ``msg`` and queue it for the core (dropped if the core never said hello)."""
        if self._sock is not None and not self._sock.closed and self._peer is not None:
            self._sock.send_multipart([self._peer, *self._link.seal(msg)])

    async def recv(self) -> tuple:
        """The next message from the core; frames from anyone else are dropped on the way."""
        while True:
            msg = await self._recv_authentic()
            if msg is not None:
                return msg

    async def _recv_authentic(self) -> tuple | None:
        peer, *frames = await self._sock.recv_multipart()
        msg = self._link.open(frames, peer=f"connection {peer.hex()}")
        if msg is not None:
            # Only the core holds the secret, so this is its connection (new one if it reconnected).
            self._peer = peer
        return msg

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the core to stop, then terminate and kill it if it does not; free the port."""
        proc = self.process
        if proc is not None and proc.is_alive():
            try:
                self.send(("shutdown",))
            except zmq.ZMQError:
                pass
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, proc.join, timeout)
            if proc.is_alive():
                logger.warning("engine core did not stop in %.0f s; terminating it", timeout)
                proc.terminate()
                await loop.run_in_executor(None, proc.join, 2.0)
            if proc.is_alive():
                proc.kill()
                await loop.run_in_executor(None, proc.join, 2.0)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


class AsyncEngineClient:
    """Async request streams on top of the engine core process.

    ``generate`` yields :class:`RequestOutput` objects (text already detokenized) until the
    request finishes; closing the iterator early aborts the request in the core.
    """

    def __init__(self, core: EngineCoreClient, output_processor: Any):
        self.core = core
        self.output_processor = output_processor
        self.stats: dict[str, Any] = {}
        self.dead_error: EngineDeadError | None = None
        #: Set while the request-level scheduler cannot take requests (its store is lost): new
        #: requests get it (503); cleared when the scheduler reports it is back.
        self.scheduler_error: FastDeployError | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None
        self._closing = False

    @property
    def max_model_len(self) -> int:
        return int(self.core.ready_info["max_model_len"])

    @property
    def config_info(self) -> dict[str, Any]:
        return self.core.ready_info.get("config_info", {})

    async def start(self) -> None:
        info = await self.core.start()
        self.stats = dict(info.get("stats") or {})
        self._loop_task = asyncio.create_task(self._output_loop(), name="engine-output-loop")
        loop = asyncio.get_running_loop()
        # The process sentinel becomes readable the instant the core exits, for any reason.
        loop.add_reader(self.core.process.sentinel, self._on_core_exit)

    def _on_core_exit(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.core.process.sentinel)
        if self._closing:
            return
        self.core.process.join(0.1)
        code = self.core.process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        self._mark_dead(f"engine core process {self.core.process.pid} {how}")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_error is not None:
            return
        logger.error("%s; failing %d in-flight request(s); /health now answers 503", reason, len(self._queues))
        self.dead_error = EngineDeadError(f"{reason}; the server must be restarted")
        for queue in self._queues.values():
            queue.put_nowait(self.dead_error)
        if self._loop_task is not None and self._loop_task is not asyncio.current_task():
            self._loop_task.cancel()

    async def _output_loop(self) -> None:
        try:
            while True:
                msg = await self.core.recv()
                kind = msg[0]
                if kind == "outputs":
                    self.stats = msg[2]
                    self._dispatch(msg[1])
                elif kind == "stats":
                    self.stats = msg[1]
                elif kind == "request_error":
                    self._fail_request(msg[1], RemoteError(msg[2]))
                elif kind == "scheduler_status":
                    self._scheduler_status(msg[1])
                elif kind == "dead":
                    self._mark_dead(f"engine core failed: {msg[1]['exc_type']}: {msg[1]['message']}")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("engine output loop failed")
            self._mark_dead(f"engine output loop failed: {exc}")

    def _scheduler_status(self, status: dict[str, Any]) -> None:
        from fastdeploy_core.scheduler.base import SchedulerUnavailableError

        if status.get("available"):
            if self.scheduler_error is not None:
                logger.info("the request scheduler is available again")
            self.scheduler_error = None
        else:
            reason = status.get("reason") or "the request scheduler is unavailable"
            logger.error("%s; new requests get 503", reason)
            self.scheduler_error = SchedulerUnavailableError(reason)

    def _dispatch(self, outputs: list[Any]) -> None:
        live = [o for o in outputs if o.request_id in self._queues]
        if not live:
            return
        processed = self.output_processor.process_outputs(live)
        for out in processed.request_outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        if processed.reqs_to_abort:
            # Stop strings matched in the API process: the core must stop generating them.
            self.core.send(("abort", list(processed.reqs_to_abort)))

    def _fail_request(self, request_id: str, exc: Exception) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(exc)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    def check_available(self) -> None:
        """Raise the reason (503) when requests cannot be served now: the core is dead, or the
        request scheduler lost its store."""
        self._check_alive()
        if self.scheduler_error is not None:
            raise self.scheduler_error

    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: Any,
        arrival_time: float | None = None,
        priority: int = 0,
        disaggregate: dict[str, Any] | None = None,
    ) -> AsyncIterator[Any]:
        """Stream the request's outputs; aborting (closing the iterator) frees it in the core.
        ``disaggregate``: the router's checked pairing (a decode instance's requests)."""
        from fastdeploy_core.engine.outputs import EngineCoreRequest

        self.check_available()
        if request_id in self._queues:
            from fastdeploy_core.errors import InvalidRequestError

            raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        arrival_time = arrival_time or time.time()
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, sampling_params, arrival_time)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            self.core.send(
                (
                    "add",
                    EngineCoreRequest(
                        request_id=request_id,
                        prompt_token_ids=list(prompt_token_ids),
                        sampling_params=sampling_params,
                        arrival_time=arrival_time,
                        priority=priority,
                        disaggregate=disaggregate,
                    ),
                )
            )
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the core no longer holds it (error or engine dead)
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort([request_id])
            self._forget(request_id)

    def abort_with_error(self, request_id: str, error: Exception) -> bool:
        """Abort ``request_id`` and make its stream raise ``error``; False if it is not in flight."""
        if request_id not in self._queues:
            return False
        self.abort([request_id])
        self._fail_request(request_id, error)
        return True

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests in the core (their KV blocks are freed before its next step)."""
        if request_ids and self.dead_error is None:
            self.core.send(("abort", list(request_ids)))

    def _forget(self, request_id: str) -> None:
        self.output_processor.abort_request(request_id)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._queues

    def active_request_ids(self) -> list[str]:
        return list(self._queues)

    async def shutdown(self) -> None:
        self._closing = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001, S110 - the loop is being stopped on purpose
                pass
        if self.core.process is not None:
            try:
                asyncio.get_running_loop().remove_reader(self.core.process.sentinel)
            except (ValueError, OSError):
                pass
        await self.core.shutdown()
