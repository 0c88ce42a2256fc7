"""One prefill and one decode instance behind a ``--splitwise`` router, against one mixed instance.

Real processes on 127.0.0.1: the router, a prefill instance (``shm`` and ``tcp``; prompt steps of
at most 128 tokens, so long prompts go in several chunks), a decode instance (``shm``) and a mixed
instance that is not registered with the router: the reference every answer is compared with.
The last test kills the prefill instance.
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.disaggregation.test_pd_serving import _all_blocks_free, _metric
from tests.entrypoints.openai.conftest import API_KEY, free_port, start_server
from tests.router.conftest import ROUTER_SECRET, start_router

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
#: Decoder layers of the default model (SmolLM2-135M): one KV batch per layer per prompt step.
DEFAULT_MODEL_LAYERS = 30

_TOPICS = ["a lighthouse keeper's logbook", "the rules of a village chess club", "a bakery's morning routine",
           "the timetable of a mountain railway"]
_PREFIXES = [f"Background ({topic}). " + " ".join(f"Entry {k}: {topic} notes item {k} in order." for k in range(18))
             + " Answer briefly.\n" for topic in _TOPICS]
_QUESTIONS = ["What is the first entry?", "Summarize the background.", "What comes after entry 3?",
              "Give one word for it:"]
_OTHERS = ["Hello", "The capital of France is", "Write a list of three colors:", "2 + 2 =",
           "def fibonacci(n):", "Translate 'good morning' to French:", "The largest planet is",
           "Once upon a time", "List the days of the week:", "The opposite of hot is",
           "A haiku about rain:\n", "Name a prime number greater than ten:",
           "The quick brown fox " * 20, "Count to five: one, two,", "Water boils at",
           "Explain recursion in one sentence:"]
#: 32 prompts: 16 sharing four long prefixes (prefix-cache hits on the prefill side), 16 others.
PROMPTS = [p + q for p in _PREFIXES for q in _QUESTIONS] + _OTHERS


def _complete(base: str, prompt: str, max_tokens: int, stream: bool, **extra) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}
    if not stream:
        resp = httpx.post(f"{base}/v1/completions", headers=AUTH, json=body, timeout=240)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]
    pieces = []
    with httpx.stream("POST", f"{base}/v1/completions", headers=AUTH, json=body, timeout=240) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                pieces.extend(c["text"] for c in chunk["choices"])
    return "".join(pieces)


def _batches(server, direction: str = "sent") -> float:
    """KV batches over shm (the one transport the decode instance offers)."""
    return _metric(server, "fastdeploy:kv_transfer_batches_total", protocol="shm", direction=direction)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("pd1"))
    router, servers = None, []
    try:
        router = start_router(tmp, "--splitwise", "--instance-ttl-secs", "3")
        common = ("--router", f"127.0.0.1:{router.port}", "--router-secret", ROUTER_SECRET)
        specs = [
            ("--splitwise-role", "prefill", "--pd-comm-port", str(free_port()), "--cache-transfer-protocol",
             "shm,tcp", "--max-num-batched-tokens", "128", *common),
            ("--splitwise-role", "decode", "--cache-transfer-protocol", "shm", *common),
            (),  # the mixed reference
        ]
        with ThreadPoolExecutor(len(specs)) as pool:
            servers = list(pool.map(lambda spec: start_server(tmp, *spec), specs))
        router.wait_for(timeout=60, prefill=1, decode=1)
        yield router, servers
    finally:
        for srv in servers:
            srv.stop()
        if router is not None:
            router.stop()


def test_32_requests_through_one_pair_give_the_mixed_tokens_and_free_every_block(pair):
    router, (prefill, decode, mixed) = pair
    # Varied budgets, half of them streamed, every fourth one past EOS (so its answer is not empty).
    jobs = [(p, 4 + (i * 5) % 11, i % 2 == 1, i % 4 == 0) for i, p in enumerate(PROMPTS)]

    def run(base: str, job) -> str:
        prompt, max_tokens, stream, ignore_eos = job
        return _complete(base, prompt, max_tokens, stream, ignore_eos=ignore_eos)

    with ThreadPoolExecutor(len(jobs)) as pool:
        routed = list(pool.map(lambda job: run(router.url, job), jobs))
        reference = list(pool.map(lambda job: run(mixed.url, job), jobs))
    assert routed == reference
    assert all(text for text, job in zip(reference, jobs) if job[3])
    assert _metric(decode, "fastdeploy:pd_transfers_completed_total") == len(jobs)
    assert _metric(decode, "fastdeploy:pd_transfers_failed_total") == 0
    # The shared prefixes were prefix-cache hits where the prompts were computed (their blocks
    # went whole, before the step's layers).
    assert _metric(prefill, "fastdeploy:hit_token_rate") > 0.1
    shm = _metric(decode, "fastdeploy:kv_transfer_bytes_total", protocol="shm", direction="received")
    assert shm > 0 and shm == _metric(prefill, "fastdeploy:kv_transfer_bytes_total", protocol="shm",
                                      direction="sent")
    _all_blocks_free([prefill, decode, mixed])


def test_a_one_step_prompt_travels_layer_by_layer(pair):
    """A 100-token prompt no earlier request shares a block with is computed in one step; its KV
    goes as one batch per decoder layer, sent while the forward runs, not one batch after it."""
    router, (prefill, decode, mixed) = pair
    prompt = "Seven quiet herons wade along the reedy shore at dusk while " * 8
    sent, received = _batches(prefill), _batches(decode, "received")
    routed = _complete(router.url, prompt, 5, False)
    assert _batches(prefill) - sent == DEFAULT_MODEL_LAYERS
    assert _batches(decode, "received") - received == DEFAULT_MODEL_LAYERS
    assert routed == _complete(mixed.url, prompt, 5, False)


def test_several_choices_prompt_logprobs_and_json_are_computed_whole_on_the_decode_side(pair):
    router, (prefill, decode, mixed) = pair
    whole = _metric(decode, "fastdeploy:pd_served_whole_total")
    transfers = _metric(decode, "fastdeploy:pd_transfers_completed_total")
    cases = [
        {"prompt": "The capital of France is", "max_tokens": 6, "n": 2, "temperature": 0.8, "seed": 7},
        {"prompt": "Write a list of three colors:", "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 2},
        {"prompt": "Give a JSON object with a name:", "max_tokens": 12, "temperature": 0,
         "response_format": {"type": "json_object"}},
    ]
    for body in cases:
        via_router = httpx.post(f"{router.url}/v1/completions", headers=AUTH, json=body, timeout=120)
        direct = httpx.post(f"{mixed.url}/v1/completions", headers=AUTH, json=body, timeout=120)
        assert via_router.status_code == 200, via_router.text
        assert direct.status_code == 200, direct.text
        got, want = via_router.json(), direct.json()
        assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
        if body.get("echo"):  # the prompt's logprobs, then the answer's
            lps = got["choices"][0]["logprobs"]
            assert lps["tokens"] == want["choices"][0]["logprobs"]["tokens"]
            assert len(lps["token_logprobs"]) > 5 and lps["token_logprobs"][0] is None
            assert lps["token_logprobs"][1:] == pytest.approx(want["choices"][0]["logprobs"]["token_logprobs"][1:],
                                                              abs=1e-4)
    assert _metric(decode, "fastdeploy:pd_served_whole_total") == whole + len(cases)
    assert _metric(decode, "fastdeploy:pd_transfers_completed_total") == transfers
    _all_blocks_free([prefill, decode, mixed])


def test_the_prefill_instance_killed_mid_prompt_fails_its_requests_and_then_the_router_answers_503(pair):
    """Long prompts in flight when the prefill instance dies: each client gets a 503 that says the
    prompt's KV did not arrive, the decode instance frees their blocks, and once the router has
    dropped the dead instance a new request is a 503 naming the missing prefill instance."""
    router, (prefill, decode, mixed) = pair
    prompts = [f"Case {i}. " + "The committee reviewed every ledger of the harbour office twice. " * 36
               for i in range(3)]
    answers: list[httpx.Response] = []

    def send(prompt: str) -> None:
        answers.append(httpx.post(f"{router.url}/v1/completions", headers=AUTH, timeout=60,
                                  json={"prompt": prompt, "max_tokens": 4, "temperature": 0}))

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(send, p) for p in prompts]
        deadline = time.monotonic() + 60
        while _metric(prefill, "fastdeploy:pd_transfers_in_flight") == 0:  # the prefill instance took them
            assert time.monotonic() < deadline, "the prefill instance never took a request"
            time.sleep(0.01)
        prefill.stop(signal.SIGKILL)
        killed = time.monotonic()
        for future in futures:
            future.result(timeout=60)
    failed = [a for a in answers if a.status_code != 200]
    assert failed, [a.text for a in answers]
    for resp in failed:
        assert resp.status_code == 503, resp.text
        assert "KV cache did not arrive" in resp.json()["error"]["message"], resp.text
    assert time.monotonic() - killed < 30
    _all_blocks_free([decode])
    # The router drops the instance it no longer hears from (ttl 3 s); then it says why it cannot pair.
    deadline = time.monotonic() + 20
    while router.counts().get("prefill", 0):
        assert time.monotonic() < deadline, "the router kept the dead prefill instance"
        time.sleep(0.2)
    gone = httpx.post(f"{router.url}/v1/completions", headers=AUTH, timeout=30,
                      json={"prompt": "Hello", "max_tokens": 2})
    assert gone.status_code == 503
    assert "no live prefill instance" in gone.json()["error"]["message"]
    _all_blocks_free([decode])
