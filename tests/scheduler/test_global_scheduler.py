"""The global scheduler's protocol against a real redis-server: queues, stealing, routing of
results to the origin, aborts, ttl, lapsed instances, signatures, and losing Redis."""

from __future__ import annotations

import time

import pytest

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.engine.outputs import EngineCoreOutput
from fastdeploy_core.errors import ConfigError
from fastdeploy_core.scheduler.base import Capacity, QueuedRequest, SchedulerUnavailableError
from fastdeploy_core.scheduler.global_scheduler import GlobalScheduler

ROOMY = Capacity(free_slots=64, free_blocks=10_000, block_size=16, token_budget=100_000, idle=True)


def config(redis_server, **extra):
    values = {"scheduler_name": "global", "scheduler_port": redis_server.port, "scheduler_secret": "test-secret",
              "scheduler_sync_period": 1, "scheduler_expire_period": 500, "scheduler_min_load_score": 2}
    values.update(extra)
    if redis_server.password and "scheduler_password" not in values:
        values["scheduler_password"] = redis_server.password
    return EngineArgs.create(**values).scheduler


_started: list[GlobalScheduler] = []


@pytest.fixture(autouse=True)
def _stop_instances():
    """Each instance's keep-alive thread stops with its test."""
    yield
    while _started:
        _started.pop().stop()


def instance(redis_server, name, **extra):
    sched = GlobalScheduler(config(redis_server, **extra), instance=name)
    sched.start()
    _started.append(sched)
    return sched


def request(rid, n=1, prompt=8):
    return QueuedRequest.from_payload({
        "request_id": rid, "prompt_token_ids": list(range(1, prompt + 1)),
        "sampling_params": {"n": n, "max_tokens": 4}, "arrival_time": time.time(), "priority": 0,
    })


def capacity(slots):
    return Capacity(free_slots=slots, free_blocks=10_000, block_size=16, token_budget=100_000, idle=slots > 0)


def steal(thief, cap=ROOMY, tries=50):
    for _ in range(tries):
        got = thief.get_requests(cap)
        if got:
            return got
        time.sleep(0.005)
    return []


def test_origin_takes_only_what_fits_and_the_rest_stays_stealable(redis_server):
    a, b = instance(redis_server, "A"), instance(redis_server, "B")
    for k in range(6):
        a.add_request(request(f"r{k}"))
    assert [r.request_id for r in a.get_requests(capacity(2))] == ["r0", "r1"]
    assert a.stats()["scheduler_queue_depth"] == 4
    stolen = steal(b, capacity(3))
    assert [r.request_id for r in stolen] == ["r2", "r3", "r4"]
    assert b.stats()["scheduler_requests_stolen"] == 3
    # B's outputs go to A's response queue, not to B's clients.
    outs = [EngineCoreOutput("r2", new_token_ids=[5], new_logprobs=[{5: -0.5, 7: -1.25}]),
            EngineCoreOutput("r2", new_token_ids=[6], finished=True, finish_reason="length")]
    assert b.put_outputs(outs) == []
    events = a.poll()
    assert [o["new_token_ids"] for o in events.outputs] == [[5], [6]]
    assert events.outputs[0]["new_logprobs"] == [{"5": -0.5, "7": -1.25}]
    assert a.stats()["scheduler_requests_sent_to_peers"] == 3
    assert b.stats()["scheduler_requests_served_for_peers"] == 1
    # A's own outputs stay with A.
    own = [EngineCoreOutput("r0", new_token_ids=[1], finished=True)]
    assert a.put_outputs(own) == own


def test_no_stealing_below_min_load_score(redis_server):
    a, b = instance(redis_server, "A", scheduler_min_load_score=3), instance(redis_server, "B",
                                                                            scheduler_min_load_score=3)
    a.add_request(request("x0"))
    a.add_request(request("x1"))
    assert steal(b, tries=20) == []
    a.add_request(request("x2"))
    assert len(steal(b)) == 3


def test_abort_reaches_the_thief_and_late_results_are_answered_with_an_abort(redis_server):
    a, b = instance(redis_server, "A"), instance(redis_server, "B")
    for k in range(3):
        a.add_request(request(f"q{k}"))
    assert len(steal(b)) == 3
    a.poll()  # learns who took them
    assert a.abort(["q0"]) == []  # runs on B: nothing to abort in A's engine
    assert b.poll().aborts == ["q0"]
    # A forgets q1 (e.g. restarted bookkeeping): B's next output for it is answered with an abort.
    a._own.pop("q1")
    b.put_outputs([EngineCoreOutput("q1", new_token_ids=[3])])
    a.poll()
    assert b.poll().aborts == ["q1"]


def test_abort_of_a_queued_request_removes_it_from_redis(redis_server):
    a = instance(redis_server, "A")
    a.add_request(request("z0"))
    a.add_request(request("z1"))
    a.abort(["z0"])
    assert [r.request_id for r in a.get_requests(ROOMY)] == ["z1"]


def test_n_choices_finish_only_when_all_have(redis_server):
    a, b = instance(redis_server, "A"), instance(redis_server, "B")
    for k in range(2):
        a.add_request(request(f"m{k}", n=2))
    assert {r.request_id for r in steal(b)} == {"m0", "m1"}
    a.poll()
    b.put_outputs([EngineCoreOutput("m0", index=0, new_token_ids=[1], finished=True)])
    assert "m0" in b._peer_work
    b.put_outputs([EngineCoreOutput("m0", index=1, new_token_ids=[2], finished=True)])
    assert "m0" not in b._peer_work
    events = a.poll()
    assert [(o["index"], o["finished"]) for o in events.outputs] == [(0, True), (1, True)]
    assert "m0" not in a._own and "m1" in a._own


def test_ttl_fails_a_queued_request_with_a_clear_error(redis_server):
    a = instance(redis_server, "A", scheduler_ttl=1)
    a.add_request(request("old"))
    time.sleep(1.2)
    a._next_expiry = 0
    events = a.poll()
    assert [rid for rid, _ in events.errors] == ["old"]
    err = events.errors[0][1]
    assert err["status"] == 503 and err["code"] == "scheduler_ttl_expired" and "--scheduler-ttl 1" in err["message"]
    assert a.get_requests(ROOMY) == []


def test_a_lapsed_thief_fails_the_origins_requests(redis_server):
    a, b = instance(redis_server, "A"), instance(redis_server, "B")
    for k in range(2):
        a.add_request(request(f"k{k}"))
    assert len(steal(b)) == 2
    a.poll()
    # B dies without a word: its keep-alive thread stops writing (the key lasts 500 ms).
    b._halt.set()
    deadline = time.monotonic() + 3
    errors = []
    while time.monotonic() < deadline and len(errors) < 2:
        errors += a.poll().errors
        time.sleep(0.05)
    assert sorted(rid for rid, _ in errors) == ["k0", "k1"]
    assert all(e["code"] == "scheduler_peer_lost" for _, e in errors)
    # A noticed B is gone and B queued nothing: B leaves the load set at once.
    assert redis_server.client().zscore("fastdeploy.default.load.0", "B") is None
    assert redis_server.client().zscore("fastdeploy.default.load.0", "A") is not None


def test_a_lapsed_origin_leaves_the_load_set_and_its_queue_is_stealable(redis_server):
    a, c = instance(redis_server, "A", scheduler_min_load_score=100), instance(redis_server, "C")
    a.add_request(request("orphan"))
    r = redis_server.client()
    r.delete("fastdeploy.default.alive.A")  # A's keep-alive lapsed
    got = steal(c)
    assert [q.request_id for q in got] == ["orphan"]
    c.get_requests(ROOMY)
    c._next_steal = 0
    c.get_requests(ROOMY)
    assert r.zscore("fastdeploy.default.load.0", "A") is None


def test_keep_alive_is_written_while_the_engine_loop_is_slow(redis_server):
    """A live instance whose loop does not poll for several expire periods (a long step on a
    loaded machine) keeps its key: peers do not fail its work."""
    a, b = instance(redis_server, "A"), instance(redis_server, "B")
    for k in range(2):
        a.add_request(request(f"s{k}"))
    assert len(steal(b)) == 2
    a.poll()
    r = redis_server.client()
    for _ in range(8):  # 2 s: four expire periods without B polling
        time.sleep(0.25)
        assert r.exists("fastdeploy.default.alive.B")
        assert a.poll().errors == []
    assert set(a._own) == {"s0", "s1"}


def test_a_hung_loop_lets_its_keep_alive_lapse(redis_server, monkeypatch):
    import fastdeploy_core.scheduler.global_scheduler as gs

    monkeypatch.setattr(gs, "LOOP_STALL_S", 0.3)
    b = instance(redis_server, "B")
    r = redis_server.client()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and r.exists("fastdeploy.default.alive.B"):
        time.sleep(0.05)
    assert not r.exists("fastdeploy.default.alive.B")
    b.poll()  # the loop turns again: the key comes back
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and not r.exists("fastdeploy.default.alive.B"):
        time.sleep(0.05)
    assert r.exists("fastdeploy.default.alive.B")


def test_values_not_signed_with_the_secret_are_dropped(redis_server):
    a = instance(redis_server, "A")
    stranger = GlobalScheduler(config(redis_server, scheduler_secret="other"), instance="X")
    stranger.start()
    _started.append(stranger)
    # A stranger pushes a request into A's queue and a fake result into A's response queue.
    r = redis_server.client()
    key = "fastdeploy.default.req.A"
    r.rpush(key, stranger.sealer.seal(key, {"origin": "A", "queued_at": time.time(),
                                             "request": request("evil").to_dict()}))
    r.rpush(key, b'{"origin": "A", "request": {}}')
    a.add_request(request("good"))
    assert [q.request_id for q in a.get_requests(ROOMY)] == ["good"]
    assert a.stats()["scheduler_rejected_values"] == 2
    # A signed value moved to another key does not verify either.
    sealed = a.sealer.seal("fastdeploy.default.req.A", {"x": 1})
    assert a.sealer.open("fastdeploy.default.resp.A", sealed) is None


def test_a_password_and_a_nonzero_db(redis_with_password):
    a = instance(redis_with_password, "A", scheduler_db=3, scheduler_secret=None)
    a.add_request(request("p0"))
    assert redis_with_password.client(db=3).llen("fastdeploy.default.req.A") == 1
    assert redis_with_password.client(db=0).llen("fastdeploy.default.req.A") == 0
    with pytest.raises(ConfigError, match="refused the password|needs a password") as err:
        GlobalScheduler.preflight(config(redis_with_password, scheduler_password="wrong"))
    assert err.value.param == "scheduler_password"


def test_unreachable_redis_names_host_port_and_flag(redis_server):
    port = redis_server.port
    redis_server.stop()
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        GlobalScheduler.preflight(config(redis_server))
    assert time.monotonic() - started < 5
    assert f"127.0.0.1:{port}" in err.value.message and "--scheduler-port" in err.value.message


def test_no_secret_no_password_is_refused(redis_server, monkeypatch):
    monkeypatch.delenv("FD_SCHEDULER_SECRET", raising=False)
    with pytest.raises(ConfigError, match="--scheduler-secret"):
        GlobalScheduler.preflight(config(redis_server, scheduler_secret=None))


def test_losing_redis_fails_in_flight_requests_and_recovers(redis_server):
    a, b = instance(redis_server, "A"), instance(redis_server, "B")
    for k in range(4):
        a.add_request(request(f"l{k}"))
    assert [q.request_id for q in a.get_requests(capacity(1))] == ["l0"]
    assert len(steal(b, capacity(1))) == 1
    b.put_outputs([EngineCoreOutput("l1", new_token_ids=[1])])
    redis_server.stop()
    events = a.poll()
    assert events.available is False and "127.0.0.1" in events.reason
    assert sorted(rid for rid, _ in events.errors) == ["l0", "l1", "l2", "l3"]
    assert all(e["code"] == "scheduler_unavailable" for _, e in events.errors)
    assert events.aborts == ["l0"]  # the one A's own engine runs
    with pytest.raises(SchedulerUnavailableError):
        a.add_request(request("new"))
    b_events = b.poll()
    assert b_events.aborts == ["l1"]
    redis_server.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not a.available:
        events = a.poll()
        time.sleep(0.1)
    assert a.available and events.available is True
    a.add_request(request("after"))
    assert [q.request_id for q in a.get_requests(ROOMY)] == ["after"]
