"""``--scheduler-name global``: instances share work through Redis; idle ones steal.

Every instance (one engine core) has, under ``fastdeploy.<topic>.``:

* ``req.<instance>``: its request queue (a list). Its clients' requests are pushed here and the
  instance pops them when its engine has room, so a request it cannot start yet stays where
  a peer can take it.
* ``resp.<instance>``: results other instances computed for its clients, in batches.
* ``ctl.<instance>``: aborts for requests it runs for others.
* ``alive.<instance>``: a keep-alive key expiring after ``--scheduler-expire-period`` ms.
* ``load.<shard>``: a sorted set of instance -> queued requests (``--scheduler-load-shards-num``
  shards; an instance's shard is a CRC16 of its name).

An instance whose own queue is empty and whose engine has room looks at the load sets every
``--scheduler-sync-period`` ms and pops from a peer holding at least
``--scheduler-min-load-score`` queued requests (or from a peer whose keep-alive lapsed: it
leaves the load set and its queue is drained by whoever comes). It tells the origin it took the
request (``taken``), then sends every output of it to the origin's ``resp`` list; the origin
hands them to its API process exactly as its own engine's outputs, so clients see the same
SSE chunks and usage. An abort goes to whoever runs the request; results for a request the
origin no longer knows are answered with an abort, so the thief frees it. A request queued
longer than ``--scheduler-ttl`` seconds fails with ``scheduler_ttl_expired``; a request taken
by a peer whose keep-alive lapses fails with ``scheduler_peer_lost``.

If Redis becomes unreachable, every in-flight request of this instance fails with the reason,
new ones are refused with 503, and the instance retries every second; once Redis answers it
announces itself again. Everything written is signed (:mod:`.signing`); nothing is unpickled.
"""

from __future__ import annotations

import binascii
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fastdeploy_core.errors import ConfigError
from fastdeploy_core.scheduler.base import (
    Admission,
    Capacity,
    PeerLostError,
    QueuedRequest,
    RequestExpiredError,
    RequestScheduler,
    SchedulerEvents,
    SchedulerUnavailableError,
    error_dict,
)
from fastdeploy_core.scheduler.signing import Sealer, signing_secret

logger = logging.getLogger("fastdeploy.scheduler")

#: Seconds a Redis connect may take before the store counts as unreachable.
REDIS_CONNECT_TIMEOUT_S = 2.0
#: Seconds a Redis command may take before the store counts as lost: generous, because on a
#: loaded machine a healthy Redis can answer late, and calling it lost fails every request.
REDIS_TIMEOUT_S = 5.0
#: Keep-alive writes per expire period: several, so a few late ones never let a live key lapse.
KEEPALIVE_WRITES_PER_EXPIRY = 5
#: Seconds without a turn of the engine loop after which the keep-alive stops being written: a
#: loop stalled that long is hung, and its peers should fail its work rather than wait forever.
LOOP_STALL_S = 60.0
#: Seconds between reconnection attempts while Redis is lost.
RECONNECT_PERIOD_S = 1.0
#: Peers a steal attempt picks among (at random), as a bound on one scan's work.
MAX_VICTIMS = 10


@dataclass(slots=True)
class _Own:
    """A request of this instance's client."""

    sealed: bytes  # the value pushed to our queue (LREM needs it)
    enqueued: float  # time.monotonic() when queued
    choices: int  # choices not finished yet
    peer: str | None = None  # the instance running it, once popped (ourselves or a thief)


@dataclass(slots=True)
class _PeerWork:
    """A request this instance took from ``origin``'s queue and runs for it."""

    origin: str
    choices: int


def _client(config):
    import redis

    password = config.scheduler_password.get_secret_value() if config.scheduler_password else None
    pool = redis.ConnectionPool(
        host=config.scheduler_host,
        port=config.scheduler_port,
        db=config.scheduler_db,
        password=password,
        socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
        socket_timeout=REDIS_TIMEOUT_S,
        max_connections=config.scheduler_reader_parallel + config.scheduler_writer_parallel,
    )
    return redis.Redis(connection_pool=pool)


def _where(config) -> str:
    return f"Redis at {config.scheduler_host}:{config.scheduler_port} (db {config.scheduler_db})"


def connect(config):
    """A client whose PING succeeded; ConfigError naming the flag to change otherwise."""
    import redis

    client = _client(config)
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        raise ConfigError(
            f"scheduler_password: {_where(config)} refused the password ({exc}); set --scheduler-password to its "
            "requirepass",
            param="scheduler_password",
        ) from None
    except redis.ResponseError as exc:
        text = str(exc)
        if "NOAUTH" in text or "AUTH" in text.upper():
            raise ConfigError(
                f"scheduler_password: {_where(config)} needs a password ({text}); set --scheduler-password",
                param="scheduler_password",
            ) from None
        if "DB index" in text:
            raise ConfigError(
                f"scheduler_db: {_where(config)} has no database {config.scheduler_db} ({text}); pick a smaller "
                "--scheduler-db",
                param="scheduler_db",
            ) from None
        raise ConfigError(f"scheduler: {_where(config)} answered PING with an error: {text}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise ConfigError(
            f"scheduler_host: cannot reach {_where(config)} ({exc}); start redis-server there or point "
            "--scheduler-host / --scheduler-port at a running one",
            param="scheduler_host",
        ) from None
    return client


class GlobalScheduler(RequestScheduler):
    """See the module docstring."""

    name = "global"
    holds_waiting_requests = True
    settings = frozenset(
        {
            "scheduler_name", "scheduler_ttl", "scheduler_host", "scheduler_port", "scheduler_db",
            "scheduler_password", "scheduler_secret", "scheduler_topic", "scheduler_min_load_score",
            "scheduler_load_shards_num", "scheduler_sync_period", "scheduler_expire_period",
            "scheduler_reader_parallel", "scheduler_writer_parallel", "scheduler_reader_batch_size",
            "scheduler_writer_batch_size",
        }
    )

    @classmethod
    def preflight(cls, config) -> None:
        signing_secret(config)
        connect(config).close()

    def __init__(self, config, instance: str | None = None):
        super().__init__(config)
        self.instance = instance or f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(3)}"
        self.sealer = Sealer(signing_secret(config), config.scheduler_topic)
        self.prefix = f"fastdeploy.{config.scheduler_topic}"
        self.redis = None
        self._own: dict[str, _Own] = {}
        self._peer_work: dict[str, _PeerWork] = {}
        self._pending = SchedulerEvents()
        self._up = False
        self._reason = ""
        self._queue_depth = 0
        self._next_sync = 0.0
        self._loop_beat = time.monotonic()
        self._halt = threading.Event()
        self._keepalive: threading.Thread | None = None
        self._next_liveness = 0.0
        self._next_expiry = 0.0
        self._next_reconnect = 0.0
        self._next_steal = 0.0
        self.num_stolen = 0
        self.num_served_for_peers = 0
        self.num_sent_to_peers = 0

    # ---- keys --------------------------------------------------------------------------------
    def _key(self, kind: str, name: str) -> str:
        return f"{self.prefix}.{kind}.{name}"

    def _load_key(self, name: str) -> str:
        shard = binascii.crc_hqx(name.encode(), 0) % self.config.scheduler_load_shards_num
        return f"{self.prefix}.load.{shard}"

    @property
    def _expire_s(self) -> float:
        return self.config.scheduler_expire_period / 1000

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.redis = connect(self.config)
        self._announce()
        self._up = True
        self._keepalive = threading.Thread(target=self._keep_alive, name="scheduler-keepalive", daemon=True)
        self._keepalive.start()
        logger.info("global scheduler: instance %s on %s, topic %r", self.instance, _where(self.config),
                    self.config.scheduler_topic)

    def _announce(self) -> None:
        """Keep-alive key and load score; a fresh queue (an old one's requests were failed)."""
        pipe = self.redis.pipeline()
        pipe.delete(self._key("req", self.instance))
        pipe.set(self._key("alive", self.instance), b"1", px=self.config.scheduler_expire_period)
        pipe.zadd(self._load_key(self.instance), {self.instance: 0})
        pipe.execute()
        self._queue_depth = 0

    def _keep_alive(self) -> None:
        """Write the keep-alive key from this thread, not from the engine loop.

        The engine loop may be slow for a while (a long prefill, a loaded machine); its peers
        must not take a live instance for dead and fail its work. Only a loop that has not
        turned for :data:`LOOP_STALL_S` counts as hung: then the key is left to lapse.
        """
        key = self._key("alive", self.instance)
        period = self._expire_s / KEEPALIVE_WRITES_PER_EXPIRY
        stalled = False
        while not self._halt.wait(period):
            if not self._up:
                continue  # the loop re-announces once it reconnects
            if time.monotonic() - self._loop_beat > LOOP_STALL_S:
                if not stalled:
                    logger.error("global scheduler: the engine loop has not turned for %.0f s; letting this "
                                 "instance's keep-alive lapse so peers fail its work", LOOP_STALL_S)
                stalled = True
                continue
            stalled = False
            try:
                self.redis.set(key, b"1", px=self.config.scheduler_expire_period)
            except Exception as exc:  # noqa: BLE001 - the loop notices a lost Redis and says so
                logger.debug("global scheduler: keep-alive not written: %s", exc)

    def stop(self) -> None:
        self._halt.set()
        if self._keepalive is not None:
            self._keepalive.join(REDIS_TIMEOUT_S + 1)
        if self.redis is None:
            return
        try:
            pipe = self.redis.pipeline()
            pipe.delete(self._key("alive", self.instance), self._key("req", self.instance))
            pipe.zrem(self._load_key(self.instance), self.instance)
            pipe.execute()
        except Exception as exc:  # noqa: BLE001 - leaving; the keep-alive lapses anyway
            logger.debug("global scheduler: could not withdraw from Redis: %s", exc)
        self.redis.close()

    @property
    def available(self) -> bool:
        return self._up

    @property
    def idle_wait_ms(self) -> int:
        return max(1, min(50, self.config.scheduler_sync_period))

    # ---- losing and regaining Redis ------------------------------------------------------------
    def _lost(self, exc: BaseException) -> None:
        if not self._up:
            return
        self._up = False
        self._reason = (
            f"the global scheduler lost {_where(self.config)} ({type(exc).__name__}: {exc}); requests are refused "
            "until it answers again (the instance reconnects by itself)"
        )
        logger.error("%s; failing %d request(s) of this instance, dropping %d run for peers",
                     self._reason, len(self._own), len(self._peer_work))
        error = error_dict(SchedulerUnavailableError(self._reason))
        for rid, own in self._own.items():
            self._pending.errors.append((rid, error))
            if own.peer == self.instance:
                self._pending.aborts.append(rid)
        self._pending.aborts.extend(self._peer_work)
        self._own.clear()
        self._peer_work.clear()
        self._pending.available = False
        self._pending.reason = self._reason
        self._next_reconnect = time.monotonic() + RECONNECT_PERIOD_S

    def _try_reconnect(self) -> None:
        now = time.monotonic()
        if now < self._next_reconnect:
            return
        self._next_reconnect = now + RECONNECT_PERIOD_S
        try:
            self.redis.ping()
            self._announce()
        except Exception as exc:  # noqa: BLE001 - still down; try again later
            logger.debug("global scheduler: Redis still unreachable: %s", exc)
            return
        self._up = True
        self._reason = ""
        self._pending.available = True
        logger.info("global scheduler: %s answers again; accepting requests", _where(self.config))

    def _redis_errors(self) -> tuple[type[BaseException], ...]:
        import redis

        return (redis.ConnectionError, redis.TimeoutError, OSError)

    # ---- the contract --------------------------------------------------------------------------
    def add_request(self, request: QueuedRequest) -> None:
        if not self._up:
            raise SchedulerUnavailableError(self._reason or "the global scheduler is not connected")
        key = self._key("req", self.instance)
        sealed = self.sealer.seal(key, {"origin": self.instance, "queued_at": time.time(), "request": request.to_dict()})
        try:
            depth = self.redis.rpush(key, sealed)
            self.redis.zadd(self._load_key(self.instance), {self.instance: int(depth)})
        except self._redis_errors() as exc:
            self._lost(exc)
            raise SchedulerUnavailableError(self._reason) from None
        self._queue_depth = int(depth)
        self._own[request.request_id] = _Own(sealed, time.monotonic(), request.num_choices)

    def get_requests(self, capacity: Capacity) -> list[QueuedRequest]:
        if not self._up:
            return []
        admission = Admission(capacity)
        if not admission.has_room():
            return []
        try:
            taken, own_empty = self._pop_own(admission)
            now = time.monotonic()
            if own_empty and admission.has_room() and now >= self._next_steal:
                self._next_steal = now + self.config.scheduler_sync_period / 1000
                taken += self._steal(admission)
        except self._redis_errors() as exc:
            self._lost(exc)
            return []
        return taken

    def _pop_own(self, admission: Admission) -> tuple[list[QueuedRequest], bool]:
        key = self._key("req", self.instance)
        want = max(1, admission.slots)
        raws = self.redis.lpop(key, want) or []
        taken: list[QueuedRequest] = []
        back: list[bytes] = []
        for raw in raws:
            if back:
                back.append(raw)
                continue
            message = self.sealer.open(key, raw)
            if message is None:
                continue
            request = QueuedRequest.from_dict(message["request"])
            own = self._own.get(request.request_id)
            if own is None or own.sealed != raw:
                continue  # aborted, expired or failed while queued
            if admission.has_room() and admission.fits(request):
                admission.take(request)
                own.peer = self.instance
                taken.append(request)
            else:
                back.append(raw)
        pipe = self.redis.pipeline()
        if back:
            pipe.lpush(key, *reversed(back))
        pipe.llen(key)
        depth = pipe.execute()[-1]
        self._queue_depth = int(depth)
        self.redis.zadd(self._load_key(self.instance), {self.instance: self._queue_depth})
        return taken, len(raws) < want and not back

    def _victims(self) -> list[str]:
        """Peers to steal from: load >= min_load_score, or keep-alive lapsed with a queue left."""
        shards = [f"{self.prefix}.load.{i}" for i in range(self.config.scheduler_load_shards_num)]
        pipe = self.redis.pipeline()
        for shard in shards:
            pipe.zrange(shard, 0, -1, withscores=True)
        members = [(shard, m.decode(), score) for shard, rows in zip(shards, pipe.execute()) for m, score in rows]
        members = [row for row in members if row[1] != self.instance]
        if not members:
            return []
        random.shuffle(members)
        members = members[:MAX_VICTIMS]
        pipe = self.redis.pipeline()
        for _, name, _ in members:
            pipe.exists(self._key("alive", name))
            pipe.llen(self._key("req", name))
        answers = pipe.execute()
        victims: list[str] = []
        cleanup = self.redis.pipeline()
        for k, (shard, name, score) in enumerate(members):
            alive, depth = answers[2 * k], int(answers[2 * k + 1])
            if not alive:
                if depth == 0:
                    cleanup.zrem(shard, name)  # gone and drained: it leaves the load set
                    logger.info("global scheduler: instance %s stopped answering; removed from the load set", name)
                else:
                    cleanup.zadd(shard, {name: depth})
                    victims.append(name)
            elif score >= self.config.scheduler_min_load_score and depth > 0:
                victims.append(name)
        cleanup.execute()
        return victims

    def _steal(self, admission: Admission) -> list[QueuedRequest]:
        taken: list[QueuedRequest] = []
        for victim in self._victims():
            if not admission.has_room():
                break
            key = self._key("req", victim)
            raws = self.redis.lpop(key, max(1, admission.slots)) or []
            back: list[bytes] = []
            notices: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for raw in raws:
                if back:
                    back.append(raw)
                    continue
                message = self.sealer.open(key, raw)
                if message is None or message.get("origin") != victim:
                    continue
                request = QueuedRequest.from_dict(message["request"])
                rid = request.request_id
                if time.time() - float(message["queued_at"]) > self.config.scheduler_ttl:
                    notices[victim].append({"id": rid, "kind": "error", "error": error_dict(self._expired(rid))})
                    continue
                if rid in self._own or rid in self._peer_work or not (admission.has_room() and admission.fits(request)):
                    back.append(raw)
                    continue
                admission.take(request)
                self._peer_work[rid] = _PeerWork(victim, request.num_choices)
                notices[victim].append({"id": rid, "kind": "taken"})
                taken.append(request)
            pipe = self.redis.pipeline()
            if back:
                pipe.lpush(key, *reversed(back))
            self._write_items(pipe, notices)
            pipe.execute()
            if taken:
                self.num_stolen += len(taken)
                logger.debug("global scheduler: stole %d request(s) from %s", len(taken), victim)
                break
        return taken

    def _expired(self, rid: str) -> RequestExpiredError:
        ttl = self.config.scheduler_ttl
        return RequestExpiredError(
            f"request {rid} waited more than --scheduler-ttl {ttl} s in the global scheduler's queue and was "
            "dropped; retry it, or raise --scheduler-ttl or add instances"
        )

    def _write_items(self, pipe, items_by_origin: dict[str, list[dict[str, Any]]]) -> None:
        """Queue result batches (at most ``--scheduler-writer-batch-size`` items each) on ``pipe``."""
        size = self.config.scheduler_writer_batch_size
        for origin, items in items_by_origin.items():
            if not items:
                continue
            key = self._key("resp", origin)
            for start in range(0, len(items), size):
                pipe.rpush(key, self.sealer.seal(key, {"from": self.instance, "items": items[start:start + size]}))
            # Results for an origin that vanished must not pile up forever.
            pipe.expire(key, max(60, self.config.scheduler_ttl))

    def put_outputs(self, outputs: list[Any]) -> list[Any]:
        mine: list[Any] = []
        remote: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for out in outputs:
            work = self._peer_work.get(out.request_id)
            if work is None:
                mine.append(out)
                own = self._own.get(out.request_id)
                if own is not None and out.finished:
                    own.choices -= 1
                    if own.choices <= 0:
                        del self._own[out.request_id]
                continue
            remote[work.origin].append({"id": out.request_id, "kind": "output", "output": out.to_dict()})
            if out.finished:
                work.choices -= 1
                if work.choices <= 0:
                    del self._peer_work[out.request_id]
                    self.num_served_for_peers += 1
        if remote and self._up:
            try:
                pipe = self.redis.pipeline()
                self._write_items(pipe, remote)
                pipe.execute()
            except self._redis_errors() as exc:
                self._lost(exc)
        return mine

    def fail(self, request: QueuedRequest, error: dict[str, Any]) -> None:
        work = self._peer_work.pop(request.request_id, None)
        if work is None:
            self._own.pop(request.request_id, None)
            super().fail(request, error)
            return
        try:
            pipe = self.redis.pipeline()
            self._write_items(pipe, {work.origin: [{"id": request.request_id, "kind": "error", "error": error}]})
            pipe.execute()
        except self._redis_errors() as exc:
            self._lost(exc)

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        here: list[str] = []
        tell: dict[str, list[str]] = defaultdict(list)
        queued: list[bytes] = []
        for rid in request_ids:
            own = self._own.pop(rid, None)
            if own is None or own.peer == self.instance:
                here.append(rid)
            elif own.peer is None:
                queued.append(own.sealed)
            else:
                tell[own.peer].append(rid)
        if self._up and (queued or tell):
            try:
                pipe = self.redis.pipeline()
                for sealed in queued:
                    # A thief may have popped it meanwhile: its "taken" then finds no request
                    # here and is answered with an abort (see poll).
                    pipe.lrem(self._key("req", self.instance), 1, sealed)
                self._send_aborts(pipe, tell)
                pipe.execute()
            except self._redis_errors() as exc:
                self._lost(exc)
        return here

    def _send_aborts(self, pipe, by_peer: dict[str, list[str]]) -> None:
        for peer, rids in by_peer.items():
            key = self._key("ctl", peer)
            pipe.rpush(key, self.sealer.seal(key, {"from": self.instance, "abort": rids}))
            pipe.expire(key, max(60, self.config.scheduler_ttl))

    def poll(self) -> SchedulerEvents:
        self._loop_beat = time.monotonic()
        events, self._pending = self._pending, SchedulerEvents()
        events.errors[:0] = self._errors
        self._errors = []
        if not self._up:
            self._try_reconnect()
            if self._pending.available is not None:
                events.available, events.reason = self._pending.available, self._pending.reason
                self._pending = SchedulerEvents()
            return events
        try:
            self._exchange(events)
            now = time.monotonic()
            if now >= self._next_liveness:
                self._next_liveness = now + self._expire_s / 4
                self._check_peers(events)
            if now >= self._next_expiry:
                self._next_expiry = now + 1.0
                self._expire_queued(events)
        except self._redis_errors() as exc:
            self._lost(exc)
        if self._pending:
            # Lost while polling: hand over what _lost produced in the same call.
            lost, self._pending = self._pending, SchedulerEvents()
            events.errors += lost.errors
            events.aborts += lost.aborts
            events.available, events.reason = lost.available, lost.reason
        return events

    def _exchange(self, events: SchedulerEvents) -> None:
        """One round trip: our results and aborts in, the load out when due."""
        resp, ctl = self._key("resp", self.instance), self._key("ctl", self.instance)
        batch = self.config.scheduler_reader_batch_size
        now = time.monotonic()
        pipe = self.redis.pipeline()
        pipe.lpop(resp, batch)
        pipe.lpop(ctl, batch)
        if now >= self._next_sync:
            self._next_sync = now + self.config.scheduler_sync_period / 1000
            pipe.zadd(self._load_key(self.instance), {self.instance: self._queue_depth})
        answers = pipe.execute()
        unknown: dict[str, list[str]] = defaultdict(list)
        for raw in answers[0] or []:
            message = self.sealer.open(resp, raw)
            if message is None:
                continue
            sender = str(message.get("from"))
            for item in message.get("items", []):
                rid = item["id"]
                own = self._own.get(rid)
                if own is None:
                    if item["kind"] != "error" and not (item["kind"] == "output" and item["output"].get("finished")):
                        unknown[sender].append(rid)  # the client is gone: the thief must stop
                    continue
                if item["kind"] == "taken":
                    own.peer = sender
                    self.num_sent_to_peers += 1
                elif item["kind"] == "output":
                    events.outputs.append(item["output"])
                    if item["output"].get("finished"):
                        own.choices -= 1
                        if own.choices <= 0:
                            del self._own[rid]
                elif item["kind"] == "error":
                    events.errors.append((rid, item["error"]))
                    del self._own[rid]
        for raw in answers[1] or []:
            message = self.sealer.open(ctl, raw)
            if message is None:
                continue
            for rid in message.get("abort", []):
                work = self._peer_work.get(rid)
                if work is not None and work.origin == message.get("from"):
                    del self._peer_work[rid]
                    events.aborts.append(rid)
        if unknown:
            pipe = self.redis.pipeline()
            self._send_aborts(pipe, {peer: sorted(set(rids)) for peer, rids in unknown.items()})
            pipe.execute()

    def _check_peers(self, events: SchedulerEvents) -> None:
        """Fail our requests held by a peer that stopped answering; drop work for a vanished origin."""
        peers = {own.peer for own in self._own.values() if own.peer not in (None, self.instance)}
        peers |= {work.origin for work in self._peer_work.values()}
        if not peers:
            return
        names = sorted(peers)
        pipe = self.redis.pipeline()
        for name in names:
            pipe.exists(self._key("alive", name))
        dead = {name for name, alive in zip(names, pipe.execute()) if not alive}
        if not dead:
            return
        for rid in [rid for rid, own in self._own.items() if own.peer in dead]:
            peer = self._own.pop(rid).peer
            events.errors.append((rid, error_dict(PeerLostError(
                f"instance {peer}, which took request {rid} from this instance's queue, stopped answering (its "
                f"keep-alive of --scheduler-expire-period {self.config.scheduler_expire_period} ms lapsed); "
                "retry the request"
            ))))
        for rid in [rid for rid, work in self._peer_work.items() if work.origin in dead]:
            del self._peer_work[rid]
            events.aborts.append(rid)
        # A dead peer with nothing queued leaves the load set now, not at the next steal attempt
        # (which waits until this instance has room).
        names = sorted(dead)
        pipe = self.redis.pipeline()
        for name in names:
            pipe.llen(self._key("req", name))
        cleanup = self.redis.pipeline()
        for name, depth in zip(names, pipe.execute()):
            if not depth:
                cleanup.zrem(self._load_key(name), name)
                logger.info("global scheduler: instance %s removed from the load set", name)
        cleanup.execute()
        logger.warning("global scheduler: instance(s) %s stopped answering", ", ".join(sorted(dead)))

    def _expire_queued(self, events: SchedulerEvents) -> None:
        ttl = self.config.scheduler_ttl
        now = time.monotonic()
        expired = [(rid, own) for rid, own in self._own.items() if own.peer is None and now - own.enqueued > ttl]
        if not expired:
            return
        pipe = self.redis.pipeline()
        for _, own in expired:
            pipe.lrem(self._key("req", self.instance), 1, own.sealed)
        for (rid, _), removed in zip(expired, pipe.execute()):
            if removed:
                del self._own[rid]
                events.errors.append((rid, error_dict(self._expired(rid))))

    def stats(self) -> dict[str, Any]:
        return {
            "scheduler_queue_depth": self._queue_depth if self._up else 0,
            "scheduler_requests_stolen": self.num_stolen,
            "scheduler_requests_served_for_peers": self.num_served_for_peers,
            "scheduler_requests_sent_to_peers": self.num_sent_to_peers,
            "scheduler_available": 1 if self._up else 0,
            "scheduler_rejected_values": self.sealer.rejected,
        }
