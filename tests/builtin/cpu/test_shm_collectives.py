"""The cpu device's shared-memory collectives between two real rank processes (gloo for the
rendezvous): sums and gathers equal on both ranks, tensors larger than a slot take gloo and
agree, many calls in a row stay in step, and no segment is left in /dev/shm."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

RANK_SCRIPT = r"""
import json, sys
import numpy as np
import paddle, paddle.distributed as dist
paddle.set_device("cpu")
dist.init_parallel_env()
from fastdeploy_core.builtin.cpu.shm_collectives import SharedMemoryCollectives
rank = dist.get_rank()
c = SharedMemoryCollectives(rank, 2, sys.argv[1], slot_bytes=4096)  # 1024 floats per slot
out = {}
x = paddle.to_tensor(np.arange(12, dtype=np.float32).reshape(3, 4) * (rank + 1))
out["sum"] = c.all_reduce(x).numpy().tolist()
big = paddle.full([2000], float(rank + 1))  # 8000 bytes: more than a slot, through gloo
out["big_sum"] = sorted(set(c.all_reduce(big).numpy().tolist()))
width = 3 if rank == 0 else 2  # uneven shares, as a vocabulary that does not divide
part = paddle.full([2, width], float(rank + 10))
out["gather"] = c.all_gather_columns(part, [3, 2]).numpy().tolist()
acc = 0.0
for step in range(500):  # both phases reused many times
    acc += float(c.all_reduce(paddle.full([1], float(step * (rank + 1)))).numpy()[0])
out["many"] = acc
print("RESULT " + json.dumps(out), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_sum_gather_fall_back_and_leave_no_segment():
    session = os.urandom(6).hex()
    ports = [_free_port() for _ in range(3)]
    common = {"PADDLE_MASTER": f"127.0.0.1:{ports[2]}", "PADDLE_TRAINERS_NUM": "2", "PADDLE_DISTRI_BACKEND": "gloo",
              "PADDLE_TRAINER_ENDPOINTS": f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}", "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(2):
        env = dict(os.environ, **common, PADDLE_TRAINER_ID=str(rank), PADDLE_CURRENT_ENDPOINT=f"127.0.0.1:{ports[rank]}")
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, session], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out[-3000:]
        results.append(json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1][7:]))
    expected_sum = [[3.0 * v for v in range(r * 4, r * 4 + 4)] for r in range(3)]
    expected_many = float(sum(3 * step for step in range(500)))
    for got in results:
        assert got["sum"] == expected_sum
        assert got["big_sum"] == [3.0]
        assert got["gather"] == [[10.0, 10.0, 10.0, 11.0, 11.0]] * 2
        assert got["many"] == expected_many
    assert not [name for name in os.listdir("/dev/shm") if session in name]
