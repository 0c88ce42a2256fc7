"""What the benchmarks that start servers on 127.0.0.1 share: a free port and the command that
runs ``fastdeploy`` from this interpreter's environment."""

from __future__ import annotations

import os
import socket
import sys


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fastdeploy() -> list[str]:
    """``fastdeploy`` next to this interpreter, else ``python -m fastdeploy_core.cli``."""
    script = os.path.join(os.path.dirname(sys.executable), "fastdeploy")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "fastdeploy_core.cli"]
