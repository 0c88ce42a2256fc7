"""A real ``fastdeploy router`` subprocess on 127.0.0.1, and instances that register with it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass

import httpx

from tests.entrypoints.openai.conftest import fastdeploy_command, free_port

ROUTER_SECRET = "router-test-secret"


@dataclass
class Router:
    proc: subprocess.Popen
    port: int
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def counts(self) -> dict[str, int]:
        return httpx.get(f"{self.url}/registered_number", timeout=5).json()

    def metrics(self) -> dict[str, float]:
        values = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def wait_for(self, timeout: float = 300, **counts: int) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            now = self.counts()
            if all(now[k] == v for k, v in counts.items()):
                return
            time.sleep(0.3)
        raise AssertionError(f"router counts {self.counts()} never became {counts}:\n{self.log()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_router(tmp_dir: str, *extra: str) -> Router:
    port = free_port()
    args = [*fastdeploy_command(), "router", "--host", "127.0.0.1", "--port", str(port),
            "--router-secret", ROUTER_SECRET, *extra]
    log_path = os.path.join(tmp_dir, f"router-{port}.log")
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1", FD_API_KEY="", FD_ROUTER_SECRET=""),
                                start_new_session=True)
    router = Router(proc, port, log_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}:\n{router.log()[-3000:]}")
        try:
            httpx.get(f"{router.url}/registered_number", timeout=2)
            return router
        except httpx.HTTPError:
            time.sleep(0.3)
    router.stop()
    raise RuntimeError(f"router did not answer within 120 s:\n{router.log()[-3000:]}")
