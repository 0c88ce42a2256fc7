"""Routing policies: which of the candidate instances gets a request.

A policy sees the candidates (instances of the role the request needs, alive) and the request's
routing view (its prompt text and an estimate of its tokens) and returns one candidate. The
load figures are the router's own counts of what it has in flight with each instance, so they
are exact for traffic that goes through this router and blind to the rest.

``cache_aware`` keeps a prefix tree of the prompts each instance has served: a request goes to
the instance that served the longest prefix of it (its KV blocks are likely still cached there)
unless the load is imbalanced past the thresholds, or the match is too short to matter; then it
goes to the least loaded instance.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from fastdeploy_core.errors import ConfigError
from fastdeploy_core.router.instances import Instance


@dataclass(slots=True)
class RoutedRequest:
    """What a policy may look at."""

    text: str
    tokens: int


class Policy:
    """Choose one of ``candidates`` (never empty) for ``request``."""

    name = "base"

    def select(self, candidates: list[Instance], request: RoutedRequest) -> Instance:
        raise NotImplementedError

    def routed(self, instance: Instance, request: RoutedRequest) -> None:
        """Called once the request went to ``instance`` (the cache-aware tree learns from it)."""


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    def select(self, candidates, request):
        return self.rng.choice(candidates)


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self):
        self.counter = 0

    def select(self, candidates, request):
        ordered = sorted(candidates, key=lambda inst: inst.key)  # stable order as instances come and go
        choice = ordered[self.counter % len(ordered)]
        self.counter += 1
        return choice


class RequestNumPolicy(Policy):
    """The instance with the fewest requests in flight (ties: the one routed to least)."""

    name = "request_num"

    def select(self, candidates, request):
        return min(candidates, key=lambda inst: (inst.in_flight, inst.routed, inst.key))


class ProcessTokensPolicy(Policy):
    """The instance with the fewest prompt tokens in flight (prefill cost follows tokens)."""

    name = "process_tokens"

    def select(self, candidates, request):
        return min(candidates, key=lambda inst: (inst.tokens_in_flight, inst.in_flight, inst.key))


class PowerOfTwoPolicy(Policy):
    """Two candidates drawn at random, the less loaded of them: near least-load without herding."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    def select(self, candidates, request):
        if len(candidates) == 1:
            return candidates[0]
        a, b = self.rng.sample(candidates, 2)
        return a if (a.in_flight, a.tokens_in_flight) <= (b.in_flight, b.tokens_in_flight) else b


class _Node:
    __slots__ = ("children", "owners")

    def __init__(self):
        self.children: dict[str, _Node] = {}
        self.owners: set[str] = set()


class PrefixTree:
    """Prompts cut into fixed-size character chunks; each node remembers which instances passed it.

    Chunks rather than single characters keep the tree small (one node per ``chunk`` characters);
    a match is counted in whole chunks. When the tree holds more than ``max_nodes`` nodes it is
    cleared: affinity is then rebuilt by the next requests, which costs hit rate for a while but
    never memory without bound.
    """

    def __init__(self, chunk: int = 16, max_nodes: int = 200_000):
        self.chunk = chunk
        self.max_nodes = max_nodes
        self.root = _Node()
        self.nodes = 0

    def _chunks(self, text: str) -> list[str]:
        return [text[i : i + self.chunk] for i in range(0, len(text) - self.chunk + 1, self.chunk)]

    def insert(self, text: str, owner: str) -> None:
        if self.nodes > self.max_nodes:
            self.root, self.nodes = _Node(), 0
        node = self.root
        for piece in self._chunks(text):
            nxt = node.children.get(piece)
            if nxt is None:
                nxt = node.children[piece] = _Node()
                self.nodes += 1
            nxt.owners.add(owner)
            node = nxt

    def match(self, text: str) -> dict[str, int]:
        """Owner -> characters of ``text`` it has served as a prefix (whole chunks)."""
        found: dict[str, int] = {}
        node = self.root
        depth = 0
        for piece in self._chunks(text):
            node = node.children.get(piece)
            if node is None:
                break
            depth += len(piece)
            for owner in node.owners:
                found[owner] = depth
        return found


class CacheAwarePolicy(Policy):
    """Longest served prefix wins, unless load is imbalanced or the match is short.

    Imbalanced: the busiest candidate has more than ``balance_abs_threshold`` requests in flight
    beyond the idlest and more than ``balance_rel_threshold`` times as many. Short: the match
    covers less than ``cache_threshold`` of the prompt. In both cases the least loaded wins.
    """

    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 4,
                 balance_rel_threshold: float = 1.5, chunk: int = 16):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = PrefixTree(chunk=chunk)
        self.least_load = RequestNumPolicy()

    def select(self, candidates, request):
        loads = [inst.in_flight for inst in candidates]
        if max(loads) - min(loads) > self.balance_abs_threshold and max(loads) > min(loads) * self.balance_rel_threshold:
            return self.least_load.select(candidates, request)
        matched = self.tree.match(request.text)
        best = max(candidates, key=lambda inst: (matched.get(inst.key, 0), -inst.in_flight))
        if request.text and matched.get(best.key, 0) >= self.cache_threshold * len(request.text):
            return best
        return self.least_load.select(candidates, request)

    def routed(self, instance, request):
        self.tree.insert(request.text, instance.key)


#: The router's own policies, by FastDeploy's router's names. The core registers them through
#: ``register_router_policies`` as a plugin registers its own.
BUILTIN_POLICIES: dict[str, type[Policy]] = {
    "random": RandomPolicy,
    "round_robin": RoundRobinPolicy,
    "power_of_two": PowerOfTwoPolicy,
    "request_num": RequestNumPolicy,
    "process_tokens": ProcessTokensPolicy,
    "cache_aware": CacheAwarePolicy,
}


def make_policy(name: str, param: str = "policy", manager=None) -> Policy:
    """A fresh policy by name: the router's own, or one a plugin registered through
    ``register_router_policies``. An unknown name is a ConfigError listing the registered ones.

    The router's own names are found without loading the plugins (which imports Paddle), so a
    router on built-in policies starts light; ``manager`` (tests) looks every name up there."""
    cls = BUILTIN_POLICIES.get(name) if manager is None else None
    if cls is None:
        from fastdeploy_core.plugins import get_plugin_manager, registered_subclass

        cls = registered_subclass(
            (manager or get_plugin_manager()).router_policies, name, Policy, param=param, what="router policy",
            hook="register_router_policies", doc="docs/writing-a-plugin.md", listed="policies",
        )
    return cls()
