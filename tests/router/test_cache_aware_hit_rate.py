"""``cache_aware`` against ``round_robin`` on real instances: the same 8 shared system prompts x
8 questions, sent one after another through a router with two mixed instances behind it, once
per policy. The prefix-cache hit rate over prompt tokens, read from the instances' ``/metrics``,
is higher with ``cache_aware``: it keeps a system prompt on the instance that already holds it,
while ``round_robin`` sends every other question of it to the instance that does not (yet).
"""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.openai.conftest import API_KEY, start_server
from tests.router.conftest import ROUTER_SECRET, start_router

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOPICS = ["astronomy", "cooking", "gardening", "history", "music", "sailing", "chess", "geology"]
QUESTIONS = [
    "What is the first thing to learn?",
    "Name one common mistake.",
    "Which book would you suggest?",
    "How long does it take to get good?",
    "What does it cost to start?",
    "Who is a famous expert?",
    "What is a good first project?",
    "Where can I practise?",
]


def system_prompt(topic: str) -> str:
    return (
        f"You are {topic.capitalize()}Guide, an assistant who answers questions about {topic} only. "
        f"Answer in one short sentence, be precise, and never change the subject away from {topic}. "
        f"If a question is not about {topic}, say that you only talk about {topic} and stop. "
        "Prefer concrete advice over general remarks, and name sources when you can.\n\nQuestion: "
    )


def hit_rate_through_router(tmp: str, policy: str) -> tuple[float, list[int]]:
    """Prefix-cache hit rate over the prompt tokens of both instances, and requests per instance."""
    router = start_router(tmp, "--policy", policy)
    servers = []
    try:
        for _ in range(2):
            servers.append(start_server(tmp, "--router", f"127.0.0.1:{router.port}", "--router-secret", ROUTER_SECRET))
        router.wait_for(timeout=60, mixed=2)
        for topic in TOPICS:  # a system prompt's questions one after another
            for question in QUESTIONS:
                resp = httpx.post(f"{router.url}/v1/completions", headers=AUTH, timeout=120,
                                  json={"prompt": system_prompt(topic) + question, "max_tokens": 1, "temperature": 0})
                assert resp.status_code == 200, resp.text
        hits = prompts = 0.0
        served = []
        for srv in servers:
            m = srv.metrics()
            tokens = m.get("fastdeploy:prompt_tokens_total", 0.0)
            hits += m["fastdeploy:hit_token_rate"] * tokens
            prompts += tokens
            served.append(int(m.get("fastdeploy:request_success_total", 0)))
        return hits / prompts, served
    finally:
        for srv in servers:
            srv.stop()
        router.stop()


def test_cache_aware_hits_the_prefix_cache_more_than_round_robin(tmp_path):
    aware, aware_served = hit_rate_through_router(str(tmp_path), "cache_aware")
    robin, robin_served = hit_rate_through_router(str(tmp_path), "round_robin")
    assert robin_served == [32, 32], robin_served
    assert min(aware_served) > 0 and sum(aware_served) == 64, aware_served  # both instances used
    assert aware > robin + 0.05, (aware, robin)
