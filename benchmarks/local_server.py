"""What the benchmarks that start servers on 127.0.0.1 share: a free port, the command that runs
``fastdeploy`` from this interpreter's environment, and the wait for a server's /health."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fastdeploy() -> list[str]:
    """``fastdeploy`` next to this interpreter, else ``python -m fastdeploy_core.cli``."""
    script = os.path.join(os.path.dirname(sys.executable), "fastdeploy")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "fastdeploy_core.cli"]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Until the server on 127.0.0.1:``port`` answers /health with 200; RuntimeError if ``proc``
    exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"instance on port {port} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"instance on port {port} not healthy in {timeout} s")
