"""Run what a user runs, in a fresh process, and check that it ended cleanly.

A teardown failure happens after the work is done (a script prints its answer, then aborts),
so only a separate interpreter's exit status and stderr show it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

#: What a clean exit never prints: Python tracebacks and unraisable-exception reports,
#: C++ terminate messages, Paddle's fatal-signal banner.
TEARDOWN_NOISE = (
    "Traceback",
    "Exception ignored",
    "terminate called",
    "EnforceNotMet",
    "FatalError",
    "Error Message Summary",
    "Segmentation fault",
    "core dumped",
)


def subprocess_env() -> dict[str, str]:
    """This environment, with one OpenMP thread unless the caller chose (the suite shares cores)."""
    return dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


def run_script(source: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``source`` as ``python -c`` in a fresh interpreter, with the cpu kernels on any CPU
    (as in the test process: the scripts check captured steps, which need them)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**subprocess_env(), "FD_CPU_KERNELS": os.environ.get("FD_CPU_KERNELS", "1")},
        check=False,
    )


def run_cli(*args: str, stdin: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``fastdeploy ARGS...`` (as ``python -m fastdeploy_core.cli``) in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "fastdeploy_core.cli", *args],
        input=stdin,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(),
    )


def assert_clean_exit(proc: subprocess.CompletedProcess) -> None:
    """Exit status 0 and none of :data:`TEARDOWN_NOISE` on stderr."""
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stderr[-3000:]}"
    noise = [marker for marker in TEARDOWN_NOISE if marker in proc.stderr]
    assert not noise, f"teardown noise {noise} on stderr:\n{proc.stderr[-3000:]}"
