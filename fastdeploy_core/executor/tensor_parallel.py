"""Tensor parallelism: one worker process per rank, driven like one model runner.

``--tensor-parallel-size N`` (``LLM(tensor_parallel_size=N)``): the engine core keeps its one
scheduler and talks to a :class:`TensorParallelRunner`, which starts N processes
(:mod:`fastdeploy_core.executor.tp_worker`), each a :class:`ModelRunner` on its rank's share of
the model (:mod:`fastdeploy_core.layers.parallel`: heads, MLP features and vocabulary split,
weights sliced as they load, each rank its own KV cache of its heads). The ranks meet through
the device's collectives (``Device.tp_collectives``): by default ``paddle.distributed`` on the
backend the device names (``Device.dist_backend``) at a rendezvous on free loopback ports whose
variables this launcher sets; the cpu device's ranks meet in shared memory, with no socket.
The device's ``rank_environment`` gives each rank its settings (the cpu device: its share of
the cores).

Every step goes to every rank; each runs the same forward (the all-reduces and the logits'
all-gather meet inside it), and each samples from the gathered logits with the same seeds;
rank 0's result is the step's. Sampling on every rank costs a little CPU and needs no second
message to tell the other ranks the tokens; their tokens are never read.

The KV cache: each rank sizes its own from its budget; all use the smallest count so a block
id means the same on every rank. Captured decode steps are off (the collectives are not
ops-table calls the recorder can replay).

A rank that dies (or fails) ends the engine: :class:`~fastdeploy_core.errors.EngineDeadError`
names the rank and quotes the end of its log; the other ranks are stopped. The serving
process turns that into 503s and exits, as for any engine death.

Not executed here: ``paddle.distributed`` ranks on a chip's backend (nccl, bkcl, xccl), ranks on
separate chips. (The default collectives ran on the cpu with gloo before the cpu device had its
own; the shared-memory ones are what the cpu device's ranks use.)
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from types import SimpleNamespace

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.errors import ConfigError, EngineDeadError, ModelLoadError
from fastdeploy_core.executor.step_io import RunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

#: How long a rank may take to load its share of the model.
STARTUP_TIMEOUT_S = 600.0
#: Lines of a failed rank's log quoted in the error.
LOG_TAIL_LINES = 12

_ERRORS = {cls.__name__: cls for cls in (ConfigError, ModelLoadError)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Rank:
    """A worker process, its end of the socket pair, its log file."""

    def __init__(self, rank: int, env: dict[str, str]):
        self.rank = rank
        ours, theirs = socket.socketpair()
        log = tempfile.NamedTemporaryFile(prefix=f"fastdeploy-tp-rank{rank}-", suffix=".log", delete=False)
        self.log_path = log.name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastdeploy_core.executor.tp_worker", str(theirs.fileno())],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=(theirs.fileno(),),
        )
        log.close()
        theirs.close()
        self.conn = Connection(ours.detach())

    def log_tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [line.rstrip() for line in f if line.strip()]
        except OSError:
            return "(no log)"
        return "\n".join(lines[-LOG_TAIL_LINES:]) or "(empty log)"

    def stop(self, timeout: float = 5.0) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass


class TensorParallelRunner:
    """What the engine core reads of a model runner, over ``tensor_parallel_size`` rank processes."""

    def __init__(self, args: EngineArgs, plugin_manager=None):
        from fastdeploy_core.plugins import load_plugins

        self.args = args
        self.size = args.parallel.tensor_parallel_size
        pm = plugin_manager or load_plugins()
        device_cls = pm.select_device(args.parallel.device)
        flat = args.flat()
        rendezvous = {
            "PADDLE_MASTER": f"127.0.0.1:{_free_port()}",
            "PADDLE_TRAINERS_NUM": str(self.size),
            "PADDLE_TRAINER_ENDPOINTS": ",".join(f"127.0.0.1:{_free_port()}" for _ in range(self.size)),
            "PADDLE_DISTRI_BACKEND": device_cls.dist_backend,
        }
        endpoints = rendezvous["PADDLE_TRAINER_ENDPOINTS"].split(",")
        self.ranks: list[_Rank] = []
        try:
            for rank in range(self.size):
                env = dict(os.environ)
                env.update(rendezvous)
                env.update(PADDLE_TRAINER_ID=str(rank), PADDLE_CURRENT_ENDPOINT=endpoints[rank])
                env.update(device_cls.rank_environment(rank, self.size))
                self.ranks.append(_Rank(rank, env))
            session = secrets.token_hex(8)
            for r in self.ranks:
                r.conn.send(("init", flat, r.rank, self.size, session))
            ready = self._gather("ready", STARTUP_TIMEOUT_S)
            self.num_blocks = min(message[1] for message in ready)
            for r in self.ranks:
                r.conn.send(("blocks", self.num_blocks))
            self._gather("sized", STARTUP_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        info = ready[0][2]
        self.info = dict(info, tensor_parallel_size=self.size, dist_backend=device_cls.dist_backend,
                         num_gpu_blocks=self.num_blocks, graph_capture="off (tensor parallelism)")
        from fastdeploy_core.loader import resolve_model_source

        self.source = resolve_model_source(args.model.model)
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.block_size = info["block_size"]
        self.max_num_batched_tokens = info["max_num_batched_tokens"]
        # what the engine core asks of the ops table (whether prompt chunks and decodes mix): rank 0's answer
        self.ops = SimpleNamespace(ragged_attention=info["ragged_attention"])
        self.model = None  # the weights live in the rank processes
        logger.info("tensor parallelism: %d ranks (%s collectives), %d KV blocks each", self.size,
                    self.info.get("collectives", "?"), self.num_blocks)

    # ---- the runner interface --------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        for r in self.ranks:
            try:
                r.conn.send(("step", scheduler_output))
            except OSError:
                self._dead(r, "its channel closed")
        return self._gather("output", None, only_rank0=True)[0][1]

    def describe(self) -> dict:
        return dict(self.info)

    def close(self) -> None:
        """Stop every rank (asked to close, killed after a few seconds). Safe to call twice."""
        for r in self.ranks:
            try:
                r.conn.send(("close",))
            except OSError:
                pass
        for r in self.ranks:
            r.stop()
        self.ranks = []

    # ---- messages ----------------------------------------------------------------------------------
    def _gather(self, kind: str, timeout: float | None, only_rank0: bool = False) -> list[tuple]:
        """One ``kind`` message from each rank (from rank 0 only if ``only_rank0``); any other
        message, a closed channel or a dead process raises."""
        pending = {r.conn: r for r in (self.ranks[:1] if only_rank0 else self.ranks)}
        watched = {r.conn: r for r in self.ranks}
        got: dict[int, tuple] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(watched), timeout=left if left is not None else 5.0)
            if not ready:
                if deadline is not None and time.monotonic() >= deadline:
                    raise EngineDeadError(f"tensor parallelism: rank(s) {sorted(r.rank for r in pending.values())} did "
                                          f"not answer {kind!r} within {timeout:.0f} s")
                for r in self.ranks:
                    if r.proc.poll() is not None:
                        self._dead(r, f"exited with status {r.proc.returncode}")
                continue
            for conn in ready:
                r = watched[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    self._dead(r, "its channel closed")
                if message[0] == "error":
                    self._failed(r, message)
                if message[0] != kind or conn not in pending:
                    raise EngineDeadError(f"tensor parallelism: rank {r.rank} sent {message[0]!r}, expected {kind!r}")
                got[r.rank] = message
                del pending[conn]
        return [got[rank] for rank in sorted(got)]

    def _dead(self, r: _Rank, how: str):
        try:
            r.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            pass
        status = r.proc.poll()
        detail = f"exit status {status}" if status is not None else how
        tail = r.log_tail()
        self.close()
        raise EngineDeadError(f"tensor parallelism: rank {r.rank} died ({detail}); the end of its log:\n{tail}")

    def _failed(self, r: _Rank, message: tuple):
        _, type_name, text, param = message
        self.close()
        cls = _ERRORS.get(type_name)
        if cls is not None:
            raise cls(text, param=param) if param else cls(text)
        error = EngineDeadError(f"tensor parallelism: rank {r.rank} failed: {type_name}: {text}")
        raise error

