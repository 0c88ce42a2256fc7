"""A real ``redis-server`` per test (free loopback port, temporary directory), stopped after it.

No test here depends on a Redis already running, and none uses a stand-in: the global
scheduler's tests talk to the server Debian's ``redis-server`` package installs
(``scripts/run_tests.sh`` installs it when it is missing).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """One redis-server process; ``stop``/``start`` keep its port (a restart mid-run)."""

    port: int
    workdir: str
    password: str | None = None
    proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> None:
        args = [shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.workdir,
                "--save", "", "--appendonly", "no", "--protected-mode", "yes", "--databases", "16"]
        if self.password:
            args += ["--requirepass", self.password]
        with open(os.path.join(self.workdir, f"redis-{self.port}.log"), "a") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                if reply.startswith((b"+PONG", b"-NOAUTH")):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def client(self, db: int = 0):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, db=db, password=self.password)


def _start(tmp_path, password=None) -> RedisServer:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed; scripts/run_tests.sh installs it (apt-get install -y redis-server)")
    server = RedisServer(free_port(), str(tmp_path), password)
    server.start()
    return server


@pytest.fixture
def redis_server(tmp_path):
    server = _start(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def redis_with_password(tmp_path):
    server = _start(tmp_path, password="s3cret-pass")
    yield server
    server.stop()
