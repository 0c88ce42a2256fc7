"""scripts/setup_env.sh: the test set-up extends the run set-up, so switching between
scripts/run_tests.sh and scripts/run_server.sh installs nothing; and the test-only example
plugin is not in the venv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Stands in for the venv's python: records each pip command instead of running it.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_CALLS"
case "$*" in *" show "*) exit 1 ;; esac
"""


@pytest.fixture
def fake_venv(tmp_path):
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    python = tmp_path / "venv" / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    calls = tmp_path / "calls"

    def setup(*args: str) -> list[str]:
        """Run the set-up; returns the pip commands it ran."""
        calls.write_text("")
        env = dict(os.environ, FD_VENV=str(tmp_path / "venv"), FAKE_CALLS=str(calls))
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts" / "setup_env.sh"), *args],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert all(line.startswith("setup: ") for line in proc.stderr.splitlines()), proc.stderr
        assert proc.stdout == ""
        return [line for line in calls.read_text().splitlines() if " install " in line]

    return setup


def test_switching_between_server_and_tests_installs_nothing(fake_venv):
    first = fake_venv()
    assert any("-e .[cpu]" in c for c in first) and not any("torch" in c for c in first)
    extra = fake_venv("test")
    assert extra and all("torch" in c or ".[cpu,test]" in c for c in extra)  # only the test dependencies
    assert fake_venv() == []
    assert fake_venv("test") == []


def test_a_test_set_up_serves_too(fake_venv):
    assert any(".[cpu,test]" in c for c in fake_venv("test"))
    assert fake_venv() == []


def _without_test_paths(env: dict) -> dict:
    """The environment minus what the test session put on PYTHONPATH (the example plugin)."""
    keep = [
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and "example_plugin" not in p and not p.startswith(os.path.join(tempfile.gettempdir(), "fd-example-chip-"))
    ]
    return dict(env, PYTHONPATH=os.pathsep.join(keep))


def test_the_venv_lists_no_test_only_plugin():
    cmd = [sys.executable, "-m", "fastdeploy_core.cli", "plugins", "--json"]
    proc = subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=120, env=_without_test_paths(dict(os.environ))
    )
    assert proc.returncode == 0, proc.stderr
    names = {row["name"] for row in json.loads(proc.stdout)["plugins"]}
    assert "builtin" in names and "example_chip" not in names, names


def test_the_test_session_installs_the_example_plugin_for_itself(example_chip_on_path):
    cmd = [sys.executable, "-m", "fastdeploy_core.cli", "plugins", "--json"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {row["name"]: row for row in json.loads(proc.stdout)["plugins"]}
    assert rows["example_chip"]["distribution"] == "fd-example-chip" and rows["example_chip"]["status"] == "loaded"


def test_every_pyproject_states_its_license_as_an_spdx_string():
    """setuptools warns at every install about a ``license = { text = ... }`` table (deprecated
    since setuptools 77): each package of the repository says ``license = "SPDX-expression"``."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
        import tomli as tomllib

    files = [ROOT / "pyproject.toml", *sorted(ROOT.glob("plugins/*/pyproject.toml"))]
    assert len(files) >= 13
    for path in files:
        with open(path, "rb") as fh:
            project = tomllib.load(fh)["project"]
        assert isinstance(project.get("license"), str), f"{path.relative_to(ROOT)}: license {project.get('license')!r}"
