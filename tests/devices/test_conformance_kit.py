"""The conformance kit: passes on cpu and on every chip plugin's ops run on the CPU place,
and fails on the example plugin's deliberately broken RMSNorm (so the kit can fail)."""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest  # noqa: E402

from fastdeploy_core.plugins import load_plugins  # noqa: E402
from fastdeploy_core.testing import checks  # noqa: E402

CHIPS = ["gpu", "dcu", "xpu", "iluvatar_gpu", "metax_gpu", "gcu", "intel_hpu"]


@pytest.fixture(scope="module")
def manager():
    return load_plugins()


def _run_all_checks(target) -> list[str]:
    """Every check of the kit on ``target``; returns the skip reasons (failures raise)."""
    skipped = []

    def run(fn, *args):
        try:
            fn(target, *args)
        except checks.CheckSkipped as exc:
            skipped.append(str(exc))

    run(checks.check_declaration)
    run(checks.check_attention_backend_selection)
    run(checks.check_detection)
    run(checks.check_memory_info)
    for dtype in target.dtypes:
        for op in checks.OPS:
            run(checks.check_op, op, dtype)
        for scenario in checks.ATTENTION_SCENARIOS:
            for backend in target.device.attention_backends:
                run(checks.check_paged_attention, scenario, backend, dtype)
    run(checks.check_generation)
    for method in target.device.quantization_methods:
        run(checks.check_quantization_method, method)
    return skipped


def test_kit_passes_on_the_cpu_device(manager):
    target = checks.make_target(manager.devices.get("cpu"))
    assert target.dtypes == ("float32",) and target.on_device
    assert _run_all_checks(target) == []


@pytest.mark.parametrize("name", CHIPS)
def test_kit_passes_on_each_chip_plugins_cpu_code_paths(manager, name):
    device = manager.devices.get(name)
    target = checks.make_target(device, place="cpu")
    assert target.ops_class is device.ops_class and not target.on_device and target.dtypes == ("float32",)
    skipped = _run_all_checks(target)
    # Only what needs the chip or the later quantization work may be skipped.
    assert any("memory cannot be read" in s for s in skipped)
    assert all("memory cannot be read" in s or "quantiz" in s for s in skipped), skipped


def test_kit_refuses_a_device_it_cannot_reach(manager):
    with pytest.raises(checks.CheckSkipped, match="not available here.*--fd-place=cpu"):
        checks.make_target(manager.devices.get("xpu"))


def test_greedy_lm_head_check_catches_a_wrong_tie_rule(manager):
    """The planted ties decide: taking the last of equal logits instead of the first fails the kit."""
    import numpy as np

    from fastdeploy_core.builtin.cpu.ops import CpuOps

    class LastOnTies(CpuOps):
        def greedy_lm_head(self, hidden, weight, bias=None, prepared=None):
            logits = self.linear(hidden, weight, bias).numpy()[:, ::-1]
            return logits.shape[1] - 1 - np.argmax(logits, axis=1)

    target = checks.make_target(manager.devices.get("cpu"), ops_class=LastOnTies)
    with pytest.raises(AssertionError, match="greedy_lm_head output"):
        checks.check_op(target, "greedy_lm_head", "float32")


def test_op_check_reports_what_differed(manager):
    from fd_nvidia.ops import NvidiaOps

    class WrongSilu(NvidiaOps):
        def silu_and_mul(self, x):
            return super().silu_and_mul(x) * 1.01

    target = checks.make_target(manager.devices.get("gpu"), ops_class=WrongSilu, place="cpu")
    with pytest.raises(AssertionError, match=r"silu_and_mul output 0 \[float32\]: max abs error"):
        checks.check_op(target, "silu_and_mul", "float32")


def _kit(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.pop("FD_ATTENTION_BACKEND", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-W", "ignore", "-p", "fastdeploy_core.testing.pytest_plugin", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_pytest_plugin_passes_on_cpu():
    proc = _kit("--fd-device=cpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_example_plugin_passes_and_its_broken_op_fails():
    pytest.importorskip("fd_example_chip", reason="pip install -e tests/example_plugin (scripts/setup_env.sh test does)")
    good = _kit("--fd-device=example_chip")
    assert good.returncode == 0, good.stdout[-3000:]
    broken = _kit("--fd-device=example_chip", "--fd-ops-class=fd_example_chip.ops:BrokenExampleOps")
    assert broken.returncode == 1, broken.stdout[-3000:]
    assert "FAILED" in broken.stdout and "test_op_parity[float32-rms_norm]" in broken.stdout
    assert "rms_norm output 0 [float32]: max abs error" in broken.stdout


def test_pytest_plugin_fails_for_an_unavailable_device_unless_asked_for_cpu_paths():
    proc = _kit("--fd-device=metax_gpu")
    assert proc.returncode != 0 and "no custom device 'metax_gpu' loaded" in proc.stdout
    unknown = _kit("--fd-device=no_such_chip")
    assert unknown.returncode != 0 and "no installed plugin registers it" in unknown.stderr
