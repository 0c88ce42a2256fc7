"""Routing policies over hand-made instances: each picks what its name promises."""

from __future__ import annotations

import importlib
import random
import time
import types

import pytest

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.errors import ConfigError
from fastdeploy_core.hookspecs import hookimpl
from fastdeploy_core.plugins import PluginManager, load_plugins
from fastdeploy_core.router.instances import DuplicateInstanceError, Instance, InstanceInfo, InstanceRegistry
from fastdeploy_core.router.policies import (
    CacheAwarePolicy,
    Policy,
    PowerOfTwoPolicy,
    PrefixTree,
    RoundRobinPolicy,
    RoutedRequest,
    make_policy,
)


def inst(port: int, in_flight: int = 0, tokens: int = 0) -> Instance:
    info = InstanceInfo(role="mixed", host="127.0.0.1", port=port)
    return Instance(info=info, last_seen=time.monotonic(), in_flight=in_flight, tokens_in_flight=tokens)


def req(text: str = "hello") -> RoutedRequest:
    return RoutedRequest(text=text, tokens=len(text) // 4 + 1)


def test_round_robin_alternates_in_address_order():
    a, b = inst(1), inst(2)
    policy = RoundRobinPolicy()
    assert [policy.select([b, a], req()).info.port for _ in range(4)] == [1, 2, 1, 2]


def test_request_num_and_process_tokens_pick_the_least_loaded():
    a, b = inst(1, in_flight=3, tokens=10), inst(2, in_flight=1, tokens=900)
    assert make_policy("request_num").select([a, b], req()).info.port == 2
    assert make_policy("process_tokens").select([a, b], req()).info.port == 1


def test_power_of_two_never_picks_the_busier_of_two():
    a, b = inst(1, in_flight=5), inst(2, in_flight=0)
    policy = PowerOfTwoPolicy(random.Random(0))
    assert {policy.select([a, b], req()).info.port for _ in range(20)} == {2}


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ConfigError, match="round_robin") as info:
        make_policy("fastest", "decode_policy")
    assert info.value.param == "decode_policy"
    assert "a third-party policy is a package registering it through register_router_policies" in info.value.message


class HighestPortPolicy(Policy):
    """A plugin's policy for the registry test: always the instance on the highest port."""

    def select(self, candidates, request):
        return max(candidates, key=lambda inst: inst.info.port)


def _manager_with(module) -> PluginManager:
    manager = load_plugins()
    fresh = PluginManager()
    for info in manager.plugins:  # the installed plugins, then the test's
        fresh.add_plugin(importlib.import_module(info.module), info.name, info.distribution, info.version)
    fresh.add_plugin(module, module.__name__, module.__name__.replace("_", "-"), "1.0")
    fresh.run_registration_hooks()
    return fresh


def _plugin(name: str, target) -> types.ModuleType:
    module = types.ModuleType(name)
    module.FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION

    @hookimpl
    def register_router_policies(register):
        register("highest_port", target)

    module.register_router_policies = register_router_policies
    return module


def test_a_plugin_registers_a_policy_through_the_hook():
    manager = _manager_with(_plugin("fd_highest", HighestPortPolicy))
    assert manager.router_policies.entry("highest_port").distribution == "fd-highest"
    assert manager.router_policies.entry("cache_aware").distribution == "fastdeploy-core"
    policy = make_policy("highest_port", manager=manager)
    assert policy.select([inst(3), inst(9, in_flight=4), inst(5)], req()).info.port == 9
    assert isinstance(make_policy("round_robin", manager=manager), RoundRobinPolicy)
    with pytest.raises(ConfigError, match="registered policies: cache_aware .*highest_port \\(fd-highest\\)"):
        make_policy("fastest", "policy", manager=manager)


def test_a_registered_non_policy_is_refused():
    manager = _manager_with(_plugin("fd_notapolicy", dict))
    with pytest.raises(ConfigError, match="not a fastdeploy_core.router.policies.Policy subclass") as info:
        make_policy("highest_port", "prefill_policy", manager=manager)
    assert info.value.param == "prefill_policy"


def test_prefix_tree_matches_whole_chunks_per_owner():
    tree = PrefixTree(chunk=4)
    tree.insert("abcdefgh", "x")
    tree.insert("abcdzzzz", "y")
    assert tree.match("abcdefghij") == {"x": 8, "y": 4}
    assert tree.match("zzzz") == {}


def test_cache_aware_follows_the_served_prefix_until_load_is_imbalanced():
    a, b = inst(1), inst(2)
    policy = CacheAwarePolicy(cache_threshold=0.5, balance_abs_threshold=2, balance_rel_threshold=1.5, chunk=4)
    system = "You are a helpful assistant. " * 4
    policy.routed(b, req(system + "first question"))
    assert policy.select([a, b], req(system + "second question")).info.port == 2
    # A short match does not count: the least loaded wins (a, by address).
    assert policy.select([a, b], req("unrelated prompt of some length")).info.port == 1
    b.in_flight = 5  # imbalanced past both thresholds: balance wins over affinity
    assert policy.select([a, b], req(system + "third question")).info.port == 1


def test_registry_refreshes_refuses_a_second_role_and_expires():
    registry = InstanceRegistry(ttl=0.2)
    info = InstanceInfo(role="prefill", host="h", port=5, transfer_endpoint="h:6")
    assert registry.register(info) is True
    assert registry.register(info) is False
    with pytest.raises(DuplicateInstanceError, match="already registered as 'prefill'"):
        registry.register(InstanceInfo(role="decode", host="h", port=5))
    assert registry.counts() == {"mixed": 0, "prefill": 1, "decode": 0}
    time.sleep(0.3)
    assert registry.counts() == {"mixed": 0, "prefill": 0, "decode": 0}
    assert registry.removed_total == 1


def test_the_guides_policy_snippet_runs_as_written():
    """docs/writing-a-plugin.md section 5, executed: it registers a policy that picks the
    instance with the fewest tokens in flight."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "writing-a-plugin.md").read_text(encoding="utf-8")
    section = doc[doc.index("## 5. A routing policy") :]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "writing-a-plugin.md", "exec"), namespace)
    registered = {}
    namespace["register_router_policies"](lambda name, cls: registered.setdefault(name, cls))
    policy = registered["least_tokens"]()
    assert isinstance(policy, Policy)
    assert policy.select([inst(1, tokens=50), inst(2, tokens=7), inst(3, tokens=9)], req()).info.port == 2
