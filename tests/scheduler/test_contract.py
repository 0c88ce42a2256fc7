"""The scheduler contract: registration, selection by name, the local scheduler's queue."""

from __future__ import annotations

import logging
import time

import pytest

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.errors import ConfigError
from fastdeploy_core.plugins import load_plugins
from fastdeploy_core.scheduler import check_scheduler, scheduler_class
from fastdeploy_core.scheduler.base import Capacity, QueuedRequest, SchedulerFullError
from fastdeploy_core.scheduler.global_scheduler import GlobalScheduler
from fastdeploy_core.scheduler.local import LocalScheduler


def request(rid, prompt=8, n=1, priority=0):
    return QueuedRequest.from_payload({
        "request_id": rid, "prompt_token_ids": [1] * prompt, "sampling_params": {"n": n},
        "arrival_time": time.time(), "priority": priority,
    })


def sched_config(**kw):
    return EngineArgs.create(**kw).scheduler


def test_builtin_plugin_registers_local_and_global():
    manager = load_plugins()
    builtin = next(p for p in manager.describe() if p["name"] == "builtin")
    assert builtin["registered"]["schedulers"] == ["local", "global"]
    assert scheduler_class("local", manager) is LocalScheduler
    assert scheduler_class("global", manager) is GlobalScheduler


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ConfigError) as err:
        scheduler_class("nosuch", load_plugins())
    assert "local (fastdeploy-core)" in err.value.message and "global (fastdeploy-core)" in err.value.message
    assert err.value.param == "scheduler_name"
    with pytest.raises(ConfigError, match="'splitwise' scheduler: prefill/decode disaggregation"):
        scheduler_class("splitwise", load_plugins())


def test_global_settings_given_with_local_are_named_in_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="fastdeploy.scheduler"):
        check_scheduler(sched_config(scheduler_port=7000, scheduler_topic="t", scheduler_ttl=5), load_plugins())
    assert "--scheduler-port, --scheduler-topic" in caplog.text
    assert "--scheduler-ttl" not in caplog.text


def test_local_hands_over_what_fits_in_order():
    sched = LocalScheduler(sched_config())
    for k in range(5):
        sched.add_request(request(f"r{k}", prompt=40))
    cap = Capacity(free_slots=3, free_blocks=100, block_size=16, token_budget=100, idle=False)
    assert [r.request_id for r in sched.get_requests(cap)] == ["r0", "r1"]  # budget 100: two prompts of 40
    cap = Capacity(free_slots=1, free_blocks=100, block_size=16, token_budget=1000, idle=False)
    assert [r.request_id for r in sched.get_requests(cap)] == ["r2"]
    cap = Capacity(free_slots=4, free_blocks=4, block_size=16, token_budget=1000, idle=False)
    assert [r.request_id for r in sched.get_requests(cap)] == ["r3"]  # 3 prompt blocks + 1 reserved each
    assert sched.stats() == {"scheduler_queue_depth": 1}
    # An idle engine always takes the first one, however long its prompt.
    sched.add_request(request("long", prompt=5000))
    cap = Capacity(free_slots=4, free_blocks=4, block_size=16, token_budget=10, idle=True)
    assert [r.request_id for r in sched.get_requests(cap)] == ["r4"]


def test_local_max_size_and_ttl():
    sched = LocalScheduler(sched_config(scheduler_max_size=2, scheduler_ttl=1))
    sched.add_request(request("a"))
    sched.add_request(request("b"))
    with pytest.raises(SchedulerFullError, match="--scheduler-max-size 2") as err:
        sched.add_request(request("c"))
    assert err.value.http_status == 503
    assert sched.abort(["a"]) == ["a"]
    time.sleep(1.1)
    events = sched.poll()
    assert [(rid, e["code"], e["status"]) for rid, e in events.errors] == [("b", "scheduler_ttl_expired", 503)]


def test_local_priority_policy_takes_the_lowest_value_first():
    sched = LocalScheduler(sched_config(policy="priority"))
    sched.add_request(request("late", priority=5))
    sched.add_request(request("urgent", priority=0))
    cap = Capacity(free_slots=1, free_blocks=100, block_size=16, token_budget=1000, idle=False)
    assert [r.request_id for r in sched.get_requests(cap)] == ["urgent"]


def test_yaml_keys_and_flags_reach_the_scheduler_section(tmp_path):
    from fastdeploy_core.cli.serve import build_configs, load_preset

    preset = tmp_path / "p.yaml"
    preset.write_text("scheduler_name: global\nscheduler-port: 6390\nscheduler_topic: blue\nscheduler_password: pw\n")
    engine, _ = build_configs(load_preset(str(preset)), {"scheduler_topic": "green"})
    s = engine.scheduler
    assert (s.scheduler_name, s.scheduler_port, s.scheduler_topic) == ("global", 6390, "green")
    assert s.scheduler_password.get_secret_value() == "pw"
    assert "pw" not in repr(engine)
    with pytest.raises(ConfigError, match="scheduler_port"):
        build_configs({}, {"scheduler_port": 0})


def test_offline_llm_refuses_a_request_level_scheduler():
    """LLM(scheduler_name="global") would be accepted and do nothing: refused before the model loads."""
    from fastdeploy_core.entrypoints.llm import LLM

    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        LLM(scheduler_name="global", scheduler_port=6390)
    assert time.monotonic() - started < 5
    assert err.value.param == "scheduler_name"
    assert "`fastdeploy serve --scheduler-name global`" in err.value.message
    assert "offline LLM" in err.value.message


def test_offline_llm_names_scheduler_settings_it_ignores(caplog):
    from fastdeploy_core.entrypoints.llm import _check_offline_scheduler

    with caplog.at_level(logging.WARNING, logger="fastdeploy"):
        _check_offline_scheduler(EngineArgs.create(scheduler_ttl=5, scheduler_max_size=3))
    assert "scheduler_max_size, scheduler_ttl apply to `fastdeploy serve` only" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastdeploy"):
        _check_offline_scheduler(EngineArgs.create())
    assert caplog.text == ""


def test_the_api_holds_requests_back_only_for_a_scheduler_without_a_shared_queue(caplog):
    """With global, every request must reach the scheduler's queue at once (idle peers take
    from there); with local the API keeps its engine-slot wait and --max-waiting-time."""
    import asyncio

    from fastdeploy_core.config import ServerConfig
    from fastdeploy_core.entrypoints.openai.api_server import _scheduler_holds_waiting
    from fastdeploy_core.entrypoints.openai.serving_engine import Admission
    from fastdeploy_core.errors import InvalidRequestError

    server = ServerConfig(max_waiting_time=10)
    assert _scheduler_holds_waiting(EngineArgs.create(), server) is False
    with caplog.at_level(logging.WARNING, logger="fastdeploy.serve"):
        assert _scheduler_holds_waiting(EngineArgs.create(scheduler_name="global"), server) is True
    assert "--max-waiting-time 10 does not apply with --scheduler-name global" in caplog.text

    async def admit_five(gate_slots):
        adm = Admission(max_concurrency=100, max_slots=2, max_waiting_time=0.2, gate_slots=gate_slots)
        outcomes = []
        for _ in range(5):
            try:
                await adm.admit(1)
                outcomes.append("admitted")
            except Exception as exc:  # noqa: BLE001 - the outcome is what the test compares
                outcomes.append(getattr(exc, "code", type(exc).__name__))
        with pytest.raises(InvalidRequestError, match="--max-num-seqs"):
            await adm.admit(3)
        return outcomes

    assert asyncio.run(admit_five(False)) == ["admitted"] * 5
    assert asyncio.run(admit_five(True)) == ["admitted"] * 2 + ["queue_timeout"] * 3
