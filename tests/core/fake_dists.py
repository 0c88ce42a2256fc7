"""Build throw-away installed distributions (dist-info + module) so discovery runs for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path


def make_dist(root: Path, dist_name: str, module: str, entry_name: str, code: str, version: str = "1.0") -> None:
    """Write ``module.py`` and a ``dist-info`` whose entry point in group fastdeploy names it."""
    (root / f"{module}.py").write_text(textwrap.dedent(code))
    info = root / f"{dist_name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[fastdeploy]\n{entry_name} = {module}\n")


def run_python(code: str, path: Path | None = None, plugins: str | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that sees the fake dists under ``path`` first."""
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = str(path) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("FD_PLUGINS", None)
    if plugins is not None:
        env["FD_PLUGINS"] = plugins
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )


DESCRIBE = """
import json, warnings
warnings.simplefilter("always")
from fastdeploy_core.plugins import load_plugins
pm = load_plugins()
print(json.dumps(pm.describe()))
"""


def describe(path: Path | None = None, plugins: str | None = None) -> tuple[list[dict], str]:
    proc = run_python(DESCRIBE, path, plugins)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


DEVICE_PLUGIN = '''
from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.devices import Availability, Device, MemoryInfo
from fastdeploy_core.hookspecs import hookimpl
FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION

class FakeChip(Device):
    name = "fakechip"
    paddle_device_type = "fakechip"
    priority = {priority}
    package = "fd-fakechip"

    @classmethod
    def detect(cls):
        return Availability.yes() if {available} else Availability.no("Paddle was not built with fakechip support")

    @classmethod
    def memory_info(cls, index=0):
        return MemoryInfo(16 << 30, 8 << 30)

@hookimpl
def register_devices(register):
    register(FakeChip)
'''
