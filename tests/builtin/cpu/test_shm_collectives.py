"""The cpu device's shared-memory collectives between two real rank processes: sums and gathers
equal on both ranks, tensors larger than a slot go through in pieces, many calls in a row stay
in step, no rank opens a socket, and no segment is left in /dev/shm."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

RANK_SCRIPT = r"""
import json, os, sys
import numpy as np
import paddle
paddle.set_device("cpu")
from fastdeploy_core.builtin.cpu.shm_collectives import SharedMemoryCollectives
rank = int(sys.argv[2])
c = SharedMemoryCollectives(rank, 2, sys.argv[1], slot_bytes=4096)  # 1024 floats per slot
out = {}
x = paddle.to_tensor(np.arange(12, dtype=np.float32).reshape(3, 4) * (rank + 1))
out["sum"] = c.all_reduce(x).numpy().tolist()
big = paddle.arange(2500, dtype="float32") * (rank + 1)  # 10000 bytes: three pieces
out["big_sum"] = c.all_reduce(big).numpy().tolist()
tall = paddle.full([700, width := 3 if rank == 0 else 2], float(rank))  # 700 rows of up to 3: 3 pieces
out["tall_gather"] = c.all_gather_columns(tall, [3, 2]).numpy().sum(axis=0).tolist()
# uneven shares, as a vocabulary that does not divide
part = paddle.full([2, width], float(rank + 10))
out["gather"] = c.all_gather_columns(part, [3, 2]).numpy().tolist()
acc = 0.0
for step in range(500):  # both phases reused many times
    acc += float(c.all_reduce(paddle.full([1], float(step * (rank + 1)))).numpy()[0])
out["many"] = acc
sockets = 0
for fd in os.listdir("/proc/self/fd"):
    try:
        sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    except OSError:  # the directory listing's own descriptor, closed by now
        pass
out["sockets"] = sockets
print("RESULT " + json.dumps(out), flush=True)
"""


def test_two_ranks_sum_gather_in_pieces_with_no_socket_and_leave_no_segment():
    session = os.urandom(6).hex()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, session, str(rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out[-3000:]
        results.append(json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1][7:]))
    expected_sum = [[3.0 * v for v in range(r * 4, r * 4 + 4)] for r in range(3)]
    expected_many = float(sum(3 * step for step in range(500)))
    for got in results:
        assert got["sum"] == expected_sum
        assert got["big_sum"] == [3.0 * v for v in range(2500)]
        assert got["tall_gather"] == [0.0, 0.0, 0.0, 700.0, 700.0]
        assert got["sockets"] == 0
        assert got["gather"] == [[10.0, 10.0, 10.0, 11.0, 11.0]] * 2
        assert got["many"] == expected_many
    assert not [name for name in os.listdir("/dev/shm") if session in name]
