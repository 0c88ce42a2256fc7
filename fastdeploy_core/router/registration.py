"""The instance side of the router: register once the server answers, then heartbeat.

``fastdeploy serve --router HOST:PORT`` starts :class:`RouterHeartbeat` in the API process. It
waits until the instance's own ``/health`` answers 200 (the model is loaded), then sends its
signed registration every ``interval`` seconds; the router drops an instance it has not heard
from for its ttl, so an instance that dies leaves the router on its own. Standard library only:
this runs beside the server and must not depend on its event loop.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import urllib.error
import urllib.request

from fastdeploy_core.router import security
from fastdeploy_core.router.instances import InstanceInfo

logger = logging.getLogger("fastdeploy.router_registration")

#: Seconds between heartbeats; the router's default ttl is five of them.
HEARTBEAT_INTERVAL_S = 2.0


def parse_address(value: str, param: str = "router") -> tuple[str, int]:
    """``HOST:PORT`` (or ``http://HOST:PORT``) as a pair; ValueError naming the flag otherwise."""
    text = value.removeprefix("http://").rstrip("/")
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--{param.replace('_', '-')}: expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def advertised_host(bind_host: str, router_host: str) -> str:
    """The address the router should use for this instance.

    A specific ``--host`` is used as is; for a wildcard one, the local address of the route to
    the router (a UDP socket's connect sends nothing), so a loopback router gets 127.0.0.1.
    """
    if bind_host not in ("", "0.0.0.0", "::"):
        return bind_host
    family = socket.AF_INET6 if ":" in router_host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((router_host, 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class RouterHeartbeat(threading.Thread):
    """Registers ``info`` with the router at ``router`` (``host:port``) and keeps it registered."""

    def __init__(self, router: str, info: InstanceInfo, secret: str, health_url: str,
                 interval: float = HEARTBEAT_INTERVAL_S):
        super().__init__(name="fastdeploy-router-heartbeat", daemon=True)
        host, port = parse_address(router)
        self.url = f"http://{host}:{port}/register"
        self.info = info
        self.key = security.router_key(secret)
        self.health_url = health_url
        self.interval = interval
        self.stopped = threading.Event()
        self.registered = False

    def stop(self) -> None:
        self.stopped.set()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def register_once(self) -> tuple[int, str]:
        """Send the registration; the router's status and body (0 and the reason if unreachable)."""
        body = json.dumps(self.info.model_dump(), separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json",
                   **security.signed_headers(self.key, security.REGISTER_LABEL, body)}
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as exc:
            return 0, str(getattr(exc, "reason", exc))

    def run(self) -> None:
        while not self.stopped.is_set() and not self._healthy():
            self.stopped.wait(0.5)
        last_problem = None
        while not self.stopped.is_set():
            status, text = self.register_once()
            if status == 200:
                if not self.registered or last_problem:
                    logger.info("registered with the router %s as a %s instance (%s)", self.url, self.info.role,
                                self.info.address)
                self.registered, last_problem = True, None
            else:
                problem = f"{status}: {text[:300]}" if status else text
                if problem != last_problem:  # once per change, not once per heartbeat
                    logger.error("the router %s refused or missed this instance's registration (%s)", self.url, problem)
                last_problem = problem
            self.stopped.wait(self.interval)
