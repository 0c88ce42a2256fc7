"""`fastdeploy env --json` lists every registered device with available/reason and its declaration."""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("OMP_NUM_THREADS", "2")

DEVICES = {"cpu", "gpu", "dcu", "xpu", "iluvatar_gpu", "metax_gpu", "gcu", "intel_hpu"}


def test_env_json_lists_every_device_with_availability_and_reason():
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.pop("FD_PLUGINS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "fastdeploy_core.cli", "env", "--json"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout[proc.stdout.index("{") :])
    rows = {row["name"]: row for row in report["devices"]}
    assert DEVICES <= set(rows)
    assert rows["cpu"]["available"] is True and rows["cpu"]["reason"] == "" and rows["cpu"]["device_count"] == 1
    for name in DEVICES - {"cpu"}:
        row = rows[name]
        assert row["available"] is False, name  # this machine runs Paddle's CPU build
        assert row["reason"] and row["device_count"] == 0, row
        for key in ("priority", "supported_dtypes", "dist_backend", "dist_env", "quantization_methods", "attention_backends", "package", "ops_class"):
            assert key in row, (name, key)
    assert rows["xpu"]["dist_backend"] == "bkcl" and "not compiled with XPU" in rows["xpu"]["reason"]
    assert rows["metax_gpu"]["dist_env"]["PADDLE_XCCL_BACKEND"] == "metax_gpu"
    assert rows["gpu"]["ops_class"] == "fd_nvidia.ops.NvidiaOps"
