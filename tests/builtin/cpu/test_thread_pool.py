"""The shared kernel thread pool (csrc/thread_pool.h) through ``fd_pool_check``: jobs started
back to back from C++ run every chunk exactly once, with their own context.

Before the pool closed a finished job's claim word ahead of writing the next job's fields, a
worker still inside the previous job could claim a stale index against the new chunk count and
run it with a half-written function / context, or count it into the new job: a rare segfault
in long test runs, and this check's counts (run here on the pool of that time: nonzero within
200,000 jobs on a 2-core machine).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import paddle
import pytest

from fastdeploy_core.builtin.cpu.kernels import load_kernels


def test_back_to_back_jobs_run_every_chunk_once():
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("the cpu kernels cannot be built here")
    wrong, out_of_range = kernels.fd_pool_check(paddle.to_tensor([200_000], dtype="int64")).numpy().tolist()
    assert (wrong, out_of_range) == (0, 0)
