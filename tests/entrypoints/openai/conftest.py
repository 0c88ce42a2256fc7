"""A real ``fastdeploy serve`` subprocess on 127.0.0.1 with the embedded default model.

Servers are expensive to start (Paddle import + model load), so the main one is shared by the
whole session; tests that kill or stop a server start their own.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import pytest

API_KEY = "test-key-1"
SECOND_KEY = "test-key-2"
STARTUP_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def fastdeploy_command() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "fastdeploy")
    if os.path.exists(script):
        return [script]
    found = shutil.which("fastdeploy")
    return [found] if found else [sys.executable, "-m", "fastdeploy_core.cli"]


@dataclass
class Server:
    """A running server process and how to reach it."""

    proc: subprocess.Popen
    port: int
    log_path: str
    args: list[str] = field(default_factory=list)
    metrics_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self, key: str | None = API_KEY) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
        return values

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(tmp_dir: str, *extra: str, api_keys: tuple[str, ...] = (API_KEY,)) -> Server:
    port = free_port()
    args = [*fastdeploy_command(), "serve", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "512", "--block-size", "16", "--max-num-seqs", "8",
            "--num-gpu-blocks-override", "512"]
    for key in api_keys:
        args += ["--api-key", key]
    args += list(extra)
    env = dict(os.environ, OMP_NUM_THREADS="2", FD_API_KEY="")
    log_path = os.path.join(tmp_dir, f"server-{port}.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(proc, port, log_path, args)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during startup:\n{server.log()[-4000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server not healthy within {STARTUP_TIMEOUT} s:\n{server.log()[-4000:]}")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    metrics_port = free_port()
    srv = start_server(str(tmp_path_factory.mktemp("serve")), "--api-key", SECOND_KEY, "--max-concurrency", "4",
                       "--metrics-port", str(metrics_port))
    srv.metrics_port = metrics_port
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_name(client):
    return client.models.list().data[0].id
