"""One prefill and one decode instance behind a ``--splitwise`` router, against one mixed instance.

Real processes on 127.0.0.1: the router, a prefill instance (``shm`` and ``tcp``; prompt steps of
at most 128 tokens, so long prompts go in several chunks), a decode instance (``shm``) and a mixed
instance that is not registered with the router: the reference every answer is compared with.
The last test kills the prefill instance.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.disaggregation.pd_client import AUTH, JOBS_32, all_blocks_free, cluster, complete, metric, run_job
from tests.entrypoints.openai.conftest import free_port

pytestmark = pytest.mark.slow

#: Decoder layers of the default model (SmolLM2-135M): one KV batch per layer per prompt step.
DEFAULT_MODEL_LAYERS = 30


def _batches(server, direction: str = "sent") -> float:
    """KV batches over shm (the one transport the decode instance offers)."""
    return metric(server, "fastdeploy:kv_transfer_batches_total", protocol="shm", direction=direction)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    specs = [
        ("--splitwise-role", "prefill", "--pd-comm-port", str(free_port()), "--cache-transfer-protocol", "shm,tcp",
         "--max-num-batched-tokens", "128"),
        ("--splitwise-role", "decode", "--cache-transfer-protocol", "shm"),
    ]
    # The third instance is the mixed reference.
    with cluster(str(tmp_path_factory.mktemp("pd1")), ("--instance-ttl-secs", "3"), specs, unrouted=1,
                 prefill=1, decode=1) as running:
        yield running


def test_32_requests_through_one_pair_give_the_mixed_tokens_and_free_every_block(pair):
    router, (prefill, decode, mixed) = pair
    jobs = JOBS_32
    with ThreadPoolExecutor(len(jobs)) as pool:
        routed = list(pool.map(lambda job: run_job(router.url, job), jobs))
        reference = list(pool.map(lambda job: run_job(mixed.url, job), jobs))
    assert routed == reference
    assert all(text for text, job in zip(reference, jobs) if job[3])
    assert metric(decode, "fastdeploy:pd_transfers_completed_total") == len(jobs)
    assert metric(decode, "fastdeploy:pd_transfers_failed_total") == 0
    # The shared prefixes were prefix-cache hits where the prompts were computed (their blocks
    # went whole, before the step's layers).
    assert metric(prefill, "fastdeploy:hit_token_rate") > 0.1
    shm = metric(decode, "fastdeploy:kv_transfer_bytes_total", protocol="shm", direction="received")
    assert shm > 0 and shm == metric(prefill, "fastdeploy:kv_transfer_bytes_total", protocol="shm",
                                      direction="sent")
    all_blocks_free([prefill, decode, mixed])


def test_a_one_step_prompt_travels_layer_by_layer(pair):
    """A 100-token prompt no earlier request shares a block with is computed in one step; its KV
    goes as one batch per decoder layer, sent while the forward runs, not one batch after it."""
    router, (prefill, decode, mixed) = pair
    prompt = "Seven quiet herons wade along the reedy shore at dusk while " * 8
    sent, received = _batches(prefill), _batches(decode, "received")
    routed = complete(router.url, prompt, 5, False)
    assert _batches(prefill) - sent == DEFAULT_MODEL_LAYERS
    assert _batches(decode, "received") - received == DEFAULT_MODEL_LAYERS
    assert routed == complete(mixed.url, prompt, 5, False)


def test_several_choices_prompt_logprobs_and_json_are_computed_whole_on_the_decode_side(pair):
    router, (prefill, decode, mixed) = pair
    whole = metric(decode, "fastdeploy:pd_served_whole_total")
    transfers = metric(decode, "fastdeploy:pd_transfers_completed_total")
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
    assert metric(decode, "fastdeploy:pd_served_whole_total") == whole + len(cases)
    assert metric(decode, "fastdeploy:pd_transfers_completed_total") == transfers
    all_blocks_free([prefill, decode, mixed])


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
        while metric(prefill, "fastdeploy:pd_transfers_in_flight") == 0:  # the prefill instance took them
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
    all_blocks_free([decode])
    # The router drops the instance it no longer hears from (ttl 3 s); then it says why it cannot pair.
    deadline = time.monotonic() + 20
    while router.counts().get("prefill", 0):
        assert time.monotonic() < deadline, "the router kept the dead prefill instance"
        time.sleep(0.2)
    gone = httpx.post(f"{router.url}/v1/completions", headers=AUTH, timeout=30,
                      json={"prompt": "Hello", "max_tokens": 2})
    assert gone.status_code == 503
    assert "no live prefill instance" in gone.json()["error"]["message"]
    all_blocks_free([decode])
