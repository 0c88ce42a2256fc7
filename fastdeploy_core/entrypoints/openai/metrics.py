"""Prometheus metrics under FastDeploy's ``fastdeploy:`` names.

Latencies and token counts are observed in the API process, per request; the engine's state
(running/waiting requests, KV blocks, prefix-cache hits) is read from the latest statistics the
engine core sent, at scrape time, so ``/metrics`` is never staler than one engine step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

try:  # created-timestamps double the output for no use here
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
except ImportError:  # pragma: no cover - old prometheus_client
    pass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


_SCHEDULER_COUNTERS = {
    "scheduler_requests_stolen": "Requests this instance took from other instances' queues",
    "scheduler_requests_served_for_peers": "Requests this instance finished for other instances' clients",
    "scheduler_requests_sent_to_peers": "Requests of this instance's clients that other instances took",
}


class _EngineStateCollector:
    """Gauges computed from the engine's latest statistics when Prometheus scrapes."""

    def __init__(self, get_stats: Callable[[], dict[str, Any]], get_api_waiting: Callable[[], int],
                 engine_alive: Callable[[], bool]):
        self._get_stats = get_stats
        self._get_api_waiting = get_api_waiting
        self._engine_alive = engine_alive

    def describe(self):
        return []

    def collect(self):
        # A dead engine runs nothing and holds no cache: its last statistics would lie.
        s = (self._get_stats() or {}) if self._engine_alive() else {}
        total = int(s.get("num_total_blocks", 0) or 0)
        free = int(s.get("num_free_blocks", 0) or 0)
        usage = s.get("cache_usage")
        if usage is None:
            usage = (total - free) / total if total else 0.0
        hit_tokens = s.get("prefix_cache_hit_tokens", 0) or 0
        queried = s.get("prefix_cache_query_tokens", 0) or 0
        hit_reqs = s.get("prefix_cache_hits", 0) or 0
        queries = s.get("prefix_cache_queries", 0) or 0
        values = {
            "num_requests_running": ("Requests being computed by the engine", s.get("num_requests_running", 0)),
            "num_requests_waiting": (
                "Requests waiting for the engine (in its queue or for a free slot)",
                int(s.get("num_requests_waiting", 0) or 0) + self._get_api_waiting(),
            ),
            "gpu_cache_usage_perc": ("KV-cache usage (fraction of blocks in use; CPU memory here)", usage),
            "free_gpu_block_num": ("Free KV-cache blocks", free),
            "max_gpu_block_num": ("KV-cache blocks allocated at startup", total),
            "hit_token_rate": ("Prefix-cache hit rate over prompt tokens", hit_tokens / queried if queried else 0.0),
            "hit_req_rate": ("Prefix-cache hit rate over requests", hit_reqs / queries if queries else 0.0),
        }
        for name, (doc, value) in values.items():
            yield GaugeMetricFamily(f"fastdeploy:{name}", doc, value=float(value or 0))
        # The request-level scheduler's (fastdeploy_core/scheduler/); global work stealing fills them.
        yield GaugeMetricFamily("fastdeploy:scheduler_queue_depth", "Requests queued in the request-level "
                                "scheduler (for global: in this instance's Redis queue)",
                                value=float(s.get("scheduler_queue_depth", 0) or 0))
        yield CounterMetricFamily("fastdeploy:num_preemptions", "Running requests preempted for blocks (recomputed "
                                  "later from their tokens)", value=float(s.get("num_preemptions", 0) or 0))
        for name, doc in _SCHEDULER_COUNTERS.items():
            yield CounterMetricFamily(f"fastdeploy:{name}", doc, value=float(s.get(name, 0) or 0))
        yield from _speculative_metrics(s)
        yield from _disaggregation_metrics(s)


def _disaggregation_metrics(s: dict[str, Any]):
    """A prefill or decode instance's transfers and the bytes each KV transport carried; nothing on
    a mixed instance."""
    role = s.get("pd_role")
    if not role:
        return
    family = CounterMetricFamily("fastdeploy:kv_transfer_bytes", "KV-cache bytes moved between prefill and decode "
                                 "instances, per transport and direction", labels=["protocol", "direction"])
    batches = CounterMetricFamily("fastdeploy:kv_transfer_batches", "KV block batches moved, per transport and "
                                  "direction", labels=["protocol", "direction"])
    for protocol, counts in sorted((s.get("kv_transfer") or {}).items()):
        for direction in ("sent", "received"):
            family.add_metric([protocol, direction], float(counts.get(f"bytes_{direction}", 0)))
            batches.add_metric([protocol, direction], float(counts.get(f"batches_{direction}", 0)))
    yield family
    yield batches
    yield GaugeMetricFamily("fastdeploy:pd_transfers_in_flight", f"Requests whose KV is being moved ({role} side)",
                            value=float(s.get("pd_transfers_in_flight", 0) or 0))
    for name in ("completed", "failed"):
        yield CounterMetricFamily(f"fastdeploy:pd_transfers_{name}", f"Prefill/decode transfers {name} "
                                  f"({role} side)", value=float(s.get(f"pd_transfers_{name}", 0) or 0))
    if "pd_served_whole" in s:
        yield CounterMetricFamily("fastdeploy:pd_served_whole", "Paired requests a decode instance computed whole "
                                  "(several choices, prompt logprobs or structured output)",
                                  value=float(s["pd_served_whole"]))


#: Speculative decoding (FastDeploy's names), present while --speculative-config is on.
_SPEC_COUNTERS = {
    "spec_decode_num_draft_tokens_total": "Draft tokens the proposer gave and the target scored",
    "spec_decode_num_accepted_tokens_total": "Draft tokens the target accepted",
    "spec_decode_num_emitted_tokens_total": "Tokens emitted by speculating steps (accepted drafts + the target's own)",
}
_SPEC_GAUGES = {
    "spec_decode_draft_acceptance_rate": "Accepted draft tokens / draft tokens scored",
    "spec_decode_mean_accepted_length": "Tokens emitted per speculating step of a request",
}


def _speculative_metrics(s: dict[str, Any]):
    """The engine's ``spec_decode_*`` statistics, labelled with the method; nothing when off."""
    method = s.get("spec_decode_method")
    if not method:
        return
    for name, doc in _SPEC_COUNTERS.items():
        family = CounterMetricFamily(f"fastdeploy:{name}", doc, labels=["method"])
        family.add_metric([method], float(s.get(name, 0) or 0))
        yield family
    for name, doc in _SPEC_GAUGES.items():
        family = GaugeMetricFamily(f"fastdeploy:{name}", doc, labels=["method"])
        family.add_metric([method], float(s.get(name, 0) or 0))
        yield family


class ServerMetrics:
    """All metrics of one server, in their own registry (several servers may live in one process)."""

    def __init__(self, get_stats: Callable[[], dict[str, Any]], get_api_waiting: Callable[[], int] = lambda: 0,
                 engine_alive: Callable[[], bool] = lambda: True):
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "fastdeploy:time_to_first_token_seconds", "Time to first token", registry=r, buckets=_LATENCY_BUCKETS)
        self.time_per_output_token = Histogram(
            "fastdeploy:time_per_output_token_seconds", "Time per output token after the first",
            registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e_latency = Histogram(
            "fastdeploy:e2e_request_latency_seconds", "End-to-end request latency", registry=r,
            buckets=_LATENCY_BUCKETS)
        self.queue_time = Histogram(
            "fastdeploy:request_queue_time_seconds", "Time a request waited before reaching the engine",
            registry=r, buckets=_LATENCY_BUCKETS)
        self.request_prompt_tokens = Histogram(
            "fastdeploy:request_prompt_tokens", "Prompt tokens per request", registry=r, buckets=_TOKEN_BUCKETS)
        self.request_generation_tokens = Histogram(
            "fastdeploy:request_generation_tokens", "Generated tokens per request", registry=r,
            buckets=_TOKEN_BUCKETS)
        self.prompt_tokens = Counter("fastdeploy:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("fastdeploy:generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter("fastdeploy:request_success", "Requests finished successfully", registry=r)
        self.requests_number = Counter("fastdeploy:requests_number", "Requests received", registry=r)
        r.register(_EngineStateCollector(get_stats, get_api_waiting, engine_alive))
        self._lock = threading.Lock()

    def render(self) -> bytes:
        with self._lock:
            return generate_latest(self.registry)

    def observe_request(
        self,
        *,
        arrival: float,
        admitted: float | None,
        first_token: float | None,
        finished: float,
        prompt_tokens: int,
        generation_tokens: int,
        success: bool,
    ) -> None:
        """Record one finished sequence (each of ``n`` choices is one; ``success`` counts a request)."""
        if admitted is not None:
            self.queue_time.observe(max(0.0, admitted - arrival))
        if first_token is not None:
            self.time_to_first_token.observe(max(0.0, first_token - arrival))
            if generation_tokens > 1:
                self.time_per_output_token.observe(max(0.0, finished - first_token) / (generation_tokens - 1))
        self.e2e_latency.observe(max(0.0, finished - arrival))
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        if success:
            self.request_success.inc()
