"""The prefill instance's side: compute paired prompts and write their KV into the decode blocks.

The prefill engine core binds a ZMQ ROUTER on ``--pd-comm-port`` (the address its ``--host``
names). A ``prefill`` message from a decode instance becomes a one-token request in this
engine (id ``pd-<transfer id>``, the decode side's sampling seed, prefix caching and chunked
prefill as configured); it is acknowledged (``accepted``) at once.

KV blocks go layer by layer while the forward runs: the runner calls :meth:`PrefillConnector.on_layer`
as each decoder layer has written its KV rows of the step (``ForwardMeta.after_layer``). For every
job in the step it sends that layer of the blocks the step completes (a block a chunk leaves
partial goes with the chunk that fills it; the prompt's last block with its last chunk) as a
``kv`` batch with ``layer`` set, gathered
from this cache into the transport's buffer (a ``/dev/shm`` file for ``shm``, a frame for
``tcp``) and addressed by position in the decode side's block list. ZMQ's I/O thread writes a
layer's bytes, and the decode instance writes them into its cache, while the next layers compute.
Blocks complete before the step (a prefix-cache hit) go whole, all layers in one batch, before
the step's first layer is sent. A model whose forward does not report layers (the PaddleFormers
fallback) sends whole blocks after each step instead, as the step completes them. When the
request's one token is sampled every block has gone, then ``first_token`` follows (the token and
its logprobs); the blocks were read before this engine could reuse them (the scheduler's
``on_finish`` hook records the finished request's block table).

An ``abort`` drops the request here; so does a decode instance that can no longer be reached
(the ROUTER refuses to route to it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastdeploy_core.disaggregation.channel import TO_DECODE, TO_PREFILL
from fastdeploy_core.devices.kv_transport import block_nbytes
from fastdeploy_core.disaggregation.connector import Connector
from fastdeploy_core.errors import KVTransferError
from fastdeploy_core.sealing import MAX_SKEW_S
from fastdeploy_core.scheduler.base import error_dict as error_payload

logger = logging.getLogger("fastdeploy.pd_prefill")


@dataclass
class _Job:
    tid: str
    peer: bytes  # the decode instance's ZMQ identity
    core_id: str  # this engine's request id
    num_prompt_tokens: int
    remote_blocks: list[int]
    protocol: str
    table: list[int] = field(default_factory=list)  # this engine's blocks of the prompt
    sent: int = 0  # blocks sent so far, every layer, final
    seq: int = 0


@dataclass
class _StepSpan:
    """A job's blocks ``[first, stop)`` that the step being computed completes (sent by layer)."""

    job: _Job
    first: int
    stop: int
    layers: int = 0  # layers sent so far


class PrefillConnector(Connector):
    """A prefill instance's transfers (see the module docstring)."""

    role = "prefill"

    def __init__(self, engine: Any, key: bytes, protocols: list[str], bind: str, zmq: Any):
        super().__init__(engine, key, protocols, zmq, TO_DECODE, TO_PREFILL)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.bind(bind)
        self.jobs: dict[str, _Job] = {}
        self.by_core_id: dict[str, str] = {}
        self.seen: dict[str, float] = {}  # transfer ids taken (a replayed prefill message is refused)
        self.finished_tables: dict[str, list[int]] = {}
        self.num_layers = len(self.views)
        self.step: Any = None  # the SchedulerOutput whose layers on_layer is sending
        self.spans: list[_StepSpan] = []
        self.dropped: list[str] = []  # jobs dropped during a forward, aborted after it
        engine.scheduler.on_finish = self._on_finish
        engine.runner.layer_listener = self.on_layer

    def attach(self, poller: Any) -> None:
        poller.register(self.sock, self.zmq.POLLIN)

    def _on_finish(self, req: Any, status: Any) -> None:
        if req.request_id in self.by_core_id:
            self.finished_tables[req.request_id] = list(req.block_table)

    # ---- messages from decode instances -------------------------------------------------------
    def service(self) -> None:
        while self.sock.poll(0):
            frames = self.sock.recv_multipart(copy=False)
            peer = bytes(frames[0].buffer)
            opened = self.channel.open(frames[1:], peer=f"decode peer {peer.hex()}")
            if opened is None:
                continue
            header, _ = opened
            self.dirty = True
            kind = header["type"]
            if kind == "prefill":
                self._start(peer, header)
            elif kind == "abort":
                job = self.jobs.get(str(header.get("tid")))
                if job is not None and job.peer == peer:
                    self._drop(job)
        now = time.monotonic()
        for tid, when in list(self.seen.items()):
            if now - when > 2 * MAX_SKEW_S:
                del self.seen[tid]

    def _start(self, peer: bytes, header: dict[str, Any]) -> None:
        tid = str(header.get("tid") or "")
        if not tid or tid in self.seen or tid in self.jobs:
            return  # a replay of a request already taken
        self.seen[tid] = time.monotonic()
        core_id = f"pd-{tid}"
        protocol = str(header.get("protocol"))
        remote = [int(b) for b in header.get("block_ids") or []]
        prompt = [int(t) for t in header.get("prompt_token_ids") or []]
        job = _Job(tid, peer, core_id, len(prompt), remote, protocol)
        try:
            if protocol not in self.transports:
                raise KVTransferError(f"KV transport {protocol!r} is not one this prefill instance offers "
                                      f"({', '.join(self.transports)})")
            if header.get("signature") != self.signature or header.get("block_size") != self.block_size:
                raise KVTransferError("the decode instance's KV cache is laid out differently (model, block size or "
                                      "--kv-cache-dtype differ); pair instances serving the same model, "
                                      "--block-size and --kv-cache-dtype")
            if len(remote) != -(-len(prompt) // self.block_size):
                raise KVTransferError(f"{len(remote)} blocks were held for a {len(prompt)}-token prompt")
            self.engine.add_remote_prompt(core_id, prompt, header.get("sampling_params") or {},
                                          int(header.get("sample_seed") or 0))
        except Exception as exc:  # noqa: BLE001 - the decode side hears why; the engine goes on
            self.failed += 1
            self._send(job, {"type": "error", "error": error_payload(exc)})
            return
        self.jobs[tid] = job
        self.by_core_id[core_id] = tid
        self._send(job, {"type": "accepted"})

    def _send(self, job: _Job, header: dict[str, Any], payload: list | tuple = ()) -> bool:
        """Send to the job's decode instance; False (and the job dropped) when it is gone."""
        header = {**header, "tid": job.tid, "seq": job.seq}
        job.seq += 1
        try:
            self.sock.send_multipart([job.peer, *self.channel.seal(header, payload)], copy=False)
            return True
        except self.zmq.ZMQError as exc:  # EHOSTUNREACH: the decode instance disconnected
            logger.warning("decode peer of transfer %s is gone (%s); request dropped", job.tid, exc)
            self.failed += 1
            self._drop(job)
            return False

    def _drop(self, job: _Job) -> None:
        self.jobs.pop(job.tid, None)
        self.by_core_id.pop(job.core_id, None)
        self.finished_tables.pop(job.core_id, None)
        if self.step is not None:  # mid-forward: the engine aborts it once the step is done
            self.dropped.append(job.core_id)
        else:
            self.engine.abort_requests([job.core_id])

    # ---- while the model computes a step --------------------------------------------------------
    def on_layer(self, step: Any, layer: int) -> None:
        """Layer ``layer`` of ``step`` (the runner's SchedulerOutput) wrote its KV rows: send them."""
        if step is not self.step:
            self._plan(step)
        for span in self.spans:
            if span.layers != layer or span.job.tid not in self.jobs:
                continue  # a layer missed (not reported): after_step sends the blocks whole
            if self._send_blocks(span.job, span.job.table, span.first, span.stop, layer):
                span.layers += 1

    def _plan(self, step: Any) -> None:
        """The jobs ``step`` computes rows of; blocks a prefix-cache hit completed go whole first."""
        self.step, self.spans = step, []
        bs = self.block_size
        for row in step.requests:
            tid = self.by_core_id.get(row.request_id)
            job = self.jobs.get(tid) if tid is not None else None
            if job is None or row.num_new_tokens < 1:
                continue
            job.table = row.block_table
            start, end = row.num_computed_tokens, row.num_computed_tokens + row.num_new_tokens
            first = start // bs
            if first > job.sent and not self._send_blocks(job, job.table, job.sent, first):
                continue
            job.sent = max(job.sent, first)
            # The blocks the step fills (the prompt's last one, partial, with its last chunk); a
            # block the step leaves partial goes with the step that fills it.
            stop = len(job.remote_blocks) if end >= job.num_prompt_tokens else end // bs
            if stop > first:
                self.spans.append(_StepSpan(job, first, stop))

    # ---- after each engine step -----------------------------------------------------------------
    def after_step(self, outputs: list) -> list:
        """Close the step's layer-by-layer sends, send the blocks a step completed that were not
        sent by layer, then the first tokens sampled; the outputs that belong to this instance's
        own clients are returned."""
        for span in self.spans:
            if span.layers == self.num_layers:
                span.job.sent = max(span.job.sent, span.stop)
        self.step, self.spans = None, []
        if self.dropped:
            self.engine.abort_requests(self.dropped)
            self.dropped = []
        requests = self.engine.scheduler.requests
        for job in list(self.jobs.values()):
            table = self.finished_tables.pop(job.core_id, None)
            if table is not None:
                complete = len(job.remote_blocks)  # finished: the partial last block too
            else:
                req = requests.get(job.core_id)
                if req is None:
                    continue
                table = req.block_table
                complete = min(req.num_computed_tokens // self.block_size, len(table), len(job.remote_blocks))
            if complete > job.sent:
                self._send_blocks(job, table, job.sent, complete)
        mine = []
        for out in outputs:
            tid = self.by_core_id.get(out.request_id)
            if tid is None:
                mine.append(out)
                continue
            job = self.jobs.get(tid)
            if job is None or not out.new_token_ids:
                continue
            if job.sent != len(job.remote_blocks):
                self._send(job, {"type": "error", "error": {"message": "the prompt's blocks were not all sent",
                                                            "status": 500}})
            else:
                logprobs = out.new_logprobs[0] if out.new_logprobs else None
                self._send(job, {"type": "first_token", "token": int(out.new_token_ids[0]), "logprobs": logprobs,
                                 "num_cached_tokens": int(out.num_cached_tokens or 0)})
                self.completed += 1
            self.jobs.pop(tid, None)
            self.by_core_id.pop(job.core_id, None)
        return mine

    def _send_blocks(self, job: _Job, table: list[int], start: int, end: int, layer: int | None = None) -> bool:
        """Send blocks ``[start, end)`` of the job's prompt: every layer (``job.sent`` moves to
        ``end``), or one ``layer``. False when the decode instance is gone (the job dropped)."""
        transport = self.transports[job.protocol]
        count = end - start
        views = self.views if layer is None else self.views[layer:layer + 1]
        buffer, handle = transport.buffer(count * block_nbytes(views), job.tid)
        transport.gather(views, table[start:end], buffer)
        description, frames = transport.send(buffer, handle)
        del buffer
        header = {"type": "kv", "start": start, "count": count, "protocol": job.protocol, "transport": description}
        if layer is not None:
            header["layer"] = layer
        if not self._send(job, header, frames):
            return False
        if layer is None:
            job.sent = end
        return True

    def take(self) -> tuple[list, list]:
        return [], []

    def in_flight(self) -> int:
        return len(self.jobs)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.close_transports()
