"""Prefill/decode with ``--kv-cache-dtype bf16`` on both instances: bfloat16 KV blocks cross the
transports as their bytes, and the answers are a mixed bf16-KV instance's.

Real processes on 127.0.0.1: a ``--splitwise`` router, a prefill instance (``shm`` and ``tcp``,
prompt steps of at most 128 tokens) and a decode instance (``shm``), both with a bfloat16 KV
cache, and a mixed instance with the same cache (not registered with the router), whose greedy
answers are the reference.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.disaggregation.pd_client import AUTH, JOBS_32, all_blocks_free, cluster, metric, run_job
from tests.entrypoints.openai.conftest import free_port, start_server

pytestmark = pytest.mark.slow

#: Shared-prefix prompts, streamed and not, and short others.
JOBS = JOBS_32[:3] + JOBS_32[16:19]


def test_bf16_blocks_travel_and_give_the_mixed_bf16_answers(tmp_path):
    bf16 = ("--kv-cache-dtype", "bf16")
    specs = [
        ("--splitwise-role", "prefill", "--pd-comm-port", str(free_port()), "--cache-transfer-protocol", "shm,tcp",
         "--max-num-batched-tokens", "128", *bf16),
        ("--splitwise-role", "decode", "--cache-transfer-protocol", "shm", *bf16),
    ]
    mixed = start_server(str(tmp_path), *bf16)
    try:
        with cluster(str(tmp_path), ("--instance-ttl-secs", "3"), specs, prefill=1, decode=1) as (router, servers):
            prefill, decode = servers
            for srv in (prefill, decode, mixed):
                info = httpx.get(f"{srv.url}/config-info", headers=AUTH, timeout=10).json()
                assert info["engine_args"]["kv_cache_dtype"] == "bfloat16"
            with ThreadPoolExecutor(len(JOBS)) as pool:
                routed = list(pool.map(lambda job: run_job(router.url, job), JOBS))
                reference = list(pool.map(lambda job: run_job(mixed.url, job), JOBS))
            assert routed == reference
            assert metric(decode, "fastdeploy:pd_transfers_completed_total") == len(JOBS)
            assert metric(decode, "fastdeploy:pd_transfers_failed_total") == 0
            shm = metric(decode, "fastdeploy:kv_transfer_bytes_total", protocol="shm", direction="received")
            assert shm > 0 and shm == metric(prefill, "fastdeploy:kv_transfer_bytes_total", protocol="shm",
                                              direction="sent")
            all_blocks_free([prefill, decode, mixed])
    finally:
        mixed.stop()
