"""The decode instance's side: hold blocks, ask the prefill instance, take the KV and the first token.

For a request the router paired with a prefill instance (``EngineCoreRequest.disaggregate``), the
decode engine core process:

1. holds blocks for the whole prompt (``EngineCore.reserve_remote``; the request-level scheduler
   hands a request over only while the free blocks hold it, so this fails only when they never
   will: then a :class:`KVTransferError` names the numbers);
2. sends the prefill instance's channel a ``prefill`` message: the prompt, the sampling
   parameters with this instance's sampling seed (so the first token is the one this instance
   would have drawn), the ids of the blocks it holds, the transport it picked and its cache's
   signature;
3. takes ``kv`` messages, in order: each names a run of the request's blocks, of every layer or
   of one (``layer``: the prefill instance sends each layer as its forward writes it), and
   carries their bytes (tcp) or where they are (shm); the transport writes them into the held
   blocks;
4. on ``first_token``, with every block written, the request joins the running batch
   (``EngineCore.admit_remote``) and its first token goes to the client; from there it decodes
   like any other request (a preempted one is recomputed here, from its tokens).

Requests with several choices, prompt logprobs or structured output are computed whole here
(:meth:`DecodeConnector.splits`). An abort (client gone, stop string) sends ``abort`` to the prefill instance, which drops the
request there too. An ``error`` message, a prefill instance that does not acknowledge within
:data:`ACCEPT_TIMEOUT_S`, or one whose connection drops, fails the request with a 503 that says so.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from fastdeploy_core.disaggregation.channel import TO_DECODE, TO_PREFILL
from fastdeploy_core.disaggregation.connector import Connector
from fastdeploy_core.errors import KVTransferError

logger = logging.getLogger("fastdeploy.pd_decode")

#: Seconds a prefill instance has to acknowledge a request before it is failed as unreachable.
ACCEPT_TIMEOUT_S = 10.0
#: ZMQ heartbeats on the connection to a prefill instance (ms): a silent peer is declared gone.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


@dataclass
class _Transfer:
    tid: str
    request_id: str  # the client's request id (engine parent id)
    request: Any  # the engine Request holding the blocks
    endpoint: str
    protocol: str
    started: float = field(default_factory=time.monotonic)
    accepted: bool = False
    next_seq: int = 0
    #: Per layer, how many of the request's blocks (from the first) hold their KV.
    layers_written: list[int] = field(default_factory=list)
    bytes: int = 0

    @property
    def blocks_written(self) -> int:
        """Blocks written in every layer."""
        return min(self.layers_written)


def is_local_host(host: str) -> bool:
    """Whether ``host`` is this machine (loopback, or one of its own addresses)."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        if host == "localhost":
            return True
    try:
        probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
        with probe:
            probe.bind((host, 0))  # only an address of this host can be bound
        return True
    except OSError:
        return False


class DecodeConnector(Connector):
    """A decode instance's transfers (see the module docstring)."""

    role = "decode"

    def __init__(self, engine: Any, key: bytes, protocols: list[str], zmq: Any):
        super().__init__(engine, key, protocols, zmq, TO_PREFILL, TO_DECODE)
        self.preference = list(protocols)
        self.poller: Any = None
        self.peers: dict[str, Any] = {}  # prefill endpoint -> DEALER socket
        self.monitors: dict[Any, str] = {}  # monitor socket -> endpoint
        self.transfers: dict[str, _Transfer] = {}
        self.by_request: dict[str, str] = {}  # client request id -> transfer id
        self.outputs: list = []  # EngineCoreOutput ready for the API process
        self.errors: list[tuple[str, dict]] = []  # (request id, error dict)
        self.served_whole = 0  # paired requests computed here whole (see splits)

    # ---- the core loop's hooks --------------------------------------------------------------
    def attach(self, poller: Any) -> None:
        self.poller = poller

    @staticmethod
    def splits(core_request: Any) -> bool:
        """Whether a paired request is computed by the prefill instance. Requests with several
        choices, prompt logprobs or structured output are computed whole here instead (the
        prefill side returns one choice's first token and no prompt logprobs, and compiles no
        grammar): their answer is the one a mixed instance gives."""
        params = core_request.sampling_params
        return params.n == 1 and params.prompt_logprobs is None and params.guided_decoding is None

    def start(self, core_request: Any) -> None:
        """Begin a paired request (raises a typed error, with nothing held, when it cannot)."""
        pairing = core_request.disaggregate
        params = core_request.sampling_params
        host, _, port = pairing["prefill"].rpartition(":")
        offered = set(pairing["protocols"])
        usable = [p for p in self.preference if p in offered
                  and (not self.transports[p].same_host_only or is_local_host(host.strip("[]")))]
        if not usable:
            raise KVTransferError(
                f"the prefill instance {pairing['prefill']} offers KV transports {sorted(offered)} and this decode "
                f"instance uses {self.preference} (shm only with a prefill instance on this host); give both a "
                "common --cache-transfer-protocol")
        request = self.engine.reserve_remote(core_request)
        if request is None:
            bm = self.engine.block_manager
            raise KVTransferError(
                f"the prompt needs {bm.blocks_needed(len(core_request.prompt_token_ids))} KV blocks and this decode "
                f"instance has {bm.num_free_blocks} free of {bm.num_blocks}; retry later or add decode capacity")
        tid = secrets.token_hex(16)
        transfer = _Transfer(tid, core_request.request_id, request, pairing["prefill"], usable[0],
                             layers_written=[0] * len(self.views))
        self.transfers[tid] = transfer
        self.by_request[core_request.request_id] = tid
        sampling = params.to_dict()
        self._send(transfer.endpoint, {
            "type": "prefill", "tid": tid, "request_id": core_request.request_id,
            "prompt_token_ids": list(request.prompt_token_ids), "sampling_params": sampling,
            "sample_seed": request.sample_seed, "block_ids": list(request.block_table),
            "protocol": transfer.protocol, "signature": self.signature, "block_size": self.block_size,
        })

    def abort(self, request_ids: list[str]) -> None:
        """The client's requests end here: the prefill instance drops them too."""
        for rid in request_ids:
            tid = self.by_request.pop(rid, None)
            transfer = self.transfers.pop(tid, None) if tid else None
            if transfer is not None:
                self._send(transfer.endpoint, {"type": "abort", "tid": tid})

    def service(self) -> None:
        """Take every message waiting on the channel; fail transfers whose prefill is gone."""
        zmq = self.zmq
        for monitor, endpoint in list(self.monitors.items()):
            while monitor.poll(0):
                from zmq.utils.monitor import recv_monitor_message

                event = recv_monitor_message(monitor)
                if event["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                    self._fail_endpoint(endpoint, "its connection dropped")
        for endpoint, sock in list(self.peers.items()):
            while sock.poll(0):
                opened = self.channel.open(sock.recv_multipart(copy=False), peer=f"prefill {endpoint}")
                if opened is not None:
                    self.dirty = True
                    self._handle(endpoint, *opened)
        now = time.monotonic()
        for transfer in list(self.transfers.values()):
            if not transfer.accepted and now - transfer.started > ACCEPT_TIMEOUT_S:
                self._fail(transfer, f"the prefill instance {transfer.endpoint} did not answer within "
                           f"{ACCEPT_TIMEOUT_S:.0f} s")

    def after_step(self, outputs: list) -> list:
        """Every output of a decode instance's step is its own clients'."""
        return outputs

    def take(self) -> tuple[list, list[tuple[str, dict]]]:
        """The outputs and errors gathered since the last call."""
        outputs, errors = self.outputs, self.errors
        self.outputs, self.errors = [], []
        return outputs, errors

    def in_flight(self) -> int:
        return len(self.transfers)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "pd_served_whole": self.served_whole}

    def close(self) -> None:
        for sock in list(self.peers.values()) + list(self.monitors):
            sock.close(linger=0)
        self.close_transports()

    # ---- messages ---------------------------------------------------------------------------
    def _socket(self, endpoint: str) -> Any:
        sock = self.peers.get(endpoint)
        if sock is None:
            zmq = self.zmq
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
            host, _, port = endpoint.rpartition(":")
            sock.connect(f"tcp://{host}:{port}")
            self.peers[endpoint] = sock
            self.monitors[monitor] = endpoint
            if self.poller is not None:
                self.poller.register(sock, zmq.POLLIN)
                self.poller.register(monitor, zmq.POLLIN)
        return sock

    def _send(self, endpoint: str, header: dict[str, Any]) -> None:
        self._socket(endpoint).send_multipart(self.channel.seal(header))

    def _handle(self, endpoint: str, header: dict[str, Any], payload: list) -> None:
        transfer = self.transfers.get(str(header.get("tid")))
        if transfer is None or transfer.endpoint != endpoint:
            return  # aborted or failed here already: late messages are dropped
        if header.get("seq") != transfer.next_seq:
            return self._fail(transfer, f"message {header.get('seq')} out of order (expected {transfer.next_seq})")
        transfer.next_seq += 1
        kind = header["type"]
        try:
            if kind == "accepted":
                transfer.accepted = True
            elif kind == "kv":
                self._write_blocks(transfer, header, payload)
            elif kind == "first_token":
                self._admit(transfer, header)
            elif kind == "error":
                error = header.get("error") or {}
                self._fail(transfer, f"the prefill instance refused it: {error.get('message', '?')}",
                           status=int(error.get("status") or 503), error=error)
            else:
                self._fail(transfer, f"unexpected message {kind!r}")
        except Exception as exc:  # noqa: BLE001 - a malformed batch fails its request, not the engine
            logger.warning("transfer %s failed: %s", transfer.tid, exc)
            self._fail(transfer, f"{type(exc).__name__}: {exc}")

    def _write_blocks(self, transfer: _Transfer, header: dict[str, Any], payload: list) -> None:
        """A ``kv`` batch: blocks ``[start, start + count)`` of every layer, or of one ``layer``. A
        batch may cover blocks written already (a prompt the prefill side recomputes after a
        preemption there is sent again) but must not leave a gap."""
        table = transfer.request.block_table
        start, count = int(header["start"]), int(header["count"])
        layer = header.get("layer")
        written = transfer.layers_written
        if layer is None:
            layers = range(len(written))
        elif not isinstance(layer, int) or not 0 <= layer < len(written):
            raise ValueError(f"a KV batch for layer {layer!r} of a {len(written)}-layer cache")
        else:
            layers = range(layer, layer + 1)
        reached = min(written[i] for i in layers)
        if start > reached or count < 1 or start + count > len(table):
            raise ValueError(f"blocks {start}..{start + count} do not continue {reached} of {len(table)}")
        if header.get("protocol") != transfer.protocol:
            raise ValueError(f"batch sent over {header.get('protocol')!r}, {transfer.protocol!r} was agreed")
        transport = self.transports[transfer.protocol]
        description = header.get("transport") or {}
        views = self.views if layer is None else self.views[layer:layer + 1]
        try:
            data = transport.receive(description, payload)
            transport.scatter(views, table[start:start + count], data)
            del data
        finally:
            transport.release(description)
        for i in layers:
            written[i] = max(written[i], start + count)
        transfer.bytes += int(description.get("nbytes", 0))

    def _admit(self, transfer: _Transfer, header: dict[str, Any]) -> None:
        request = transfer.request
        if transfer.blocks_written != len(request.block_table):
            raise ValueError(f"first token after {transfer.blocks_written} of {len(request.block_table)} blocks")
        self.transfers.pop(transfer.tid, None)
        self.by_request.pop(transfer.request_id, None)
        logprobs = header.get("logprobs")
        self.outputs.append(self.engine.admit_remote(request, int(header["token"]), logprobs,
                                                     int(header.get("num_cached_tokens") or 0)))
        self.completed += 1
        logger.debug("request %s: %d blocks (%d bytes) over %s", transfer.request_id, transfer.blocks_written,
                     transfer.bytes, transfer.protocol)

    def _fail_endpoint(self, endpoint: str, why: str) -> None:
        for transfer in [t for t in self.transfers.values() if t.endpoint == endpoint]:
            self._fail(transfer, f"the prefill instance {endpoint}: {why}")

    def _fail(self, transfer: _Transfer, why: str, status: int = 503, error: dict | None = None) -> None:
        if self.transfers.pop(transfer.tid, None) is None:
            return
        self.by_request.pop(transfer.request_id, None)
        self.engine.abort_requests([transfer.request_id])  # frees the held blocks
        self.failed += 1
        err = KVTransferError(f"request {transfer.request_id}: the prompt's KV cache did not arrive ({why})")
        payload = {"message": err.message, "type": err.error_type, "status": status, "param": None,
                   "code": err.code, "exc_type": type(err).__name__}
        if error and status < 500:
            payload.update({k: error[k] for k in ("type", "param", "code", "exc_type") if k in error})
        self.errors.append((transfer.request_id, payload))
        logger.warning("%s", err.message)
