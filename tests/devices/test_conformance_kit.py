"""The conformance kit: passes on cpu and on the chip plugins' ops run on the CPU place, and
fails on the example plugin's deliberately broken RMSNorm (so the kit can fail).

The seven chip ops classes share their code (each adds declarations to ``FusedOps``), so the
kit's op, attention, generation and quantization checks run once per distinct ops code on the
CPU place, over every attention backend and quantization method the chips sharing it declare;
what differs per chip (its declared methods, backends, dtypes and expected kernels) is checked
per chip."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest  # noqa: E402

from fastdeploy_core.devices.fused_ops import FusedOps  # noqa: E402
from fastdeploy_core.devices.kernels import registered_kernels  # noqa: E402
from fastdeploy_core.plugins import load_plugins  # noqa: E402
from fastdeploy_core.testing import checks  # noqa: E402

CHIPS = ["gpu", "dcu", "xpu", "iluvatar_gpu", "metax_gpu", "gcu", "intel_hpu"]


@pytest.fixture(scope="module")
def manager():
    return load_plugins()


def _run_all_checks(target, backends=None, methods=None) -> list[str]:
    """Every check of the kit on ``target``; returns the skip reasons (failures raise).

    ``backends``/``methods``: (device, name) pairs to run instead of the target device's own,
    for a run that stands for several devices sharing one ops class."""
    skipped = []

    def run(fn, *args):
        try:
            fn(*args)
        except checks.CheckSkipped as exc:
            skipped.append(str(exc))

    run(checks.check_declaration, target)
    run(checks.check_attention_backend_selection, target)
    run(checks.check_detection, target)
    run(checks.check_memory_info, target)
    backends = backends or [(target, b) for b in target.device.attention_backends]
    for dtype in target.dtypes:
        for op in checks.OPS:
            run(checks.check_op, target, op, dtype)
        for scenario in checks.ATTENTION_SCENARIOS:
            for backend_target, backend in backends:
                run(checks.check_paged_attention, backend_target, scenario, backend, dtype)
    for scenario in checks.ATTENTION_SCENARIOS:
        for backend_target, backend in backends:
            run(checks.check_bf16_kv_cache, backend_target, scenario, backend)
    run(checks.check_generation, target)
    for method_target, method in methods or [(target, m) for m in target.device.quantization_methods]:
        run(checks.check_quantization_method, method_target, method)
    return skipped


def test_kit_passes_on_the_cpu_device(manager):
    target = checks.make_target(manager.devices.get("cpu"))
    assert target.dtypes == ("float32",) and target.on_device
    assert _run_all_checks(target) == []


def ops_code(ops_class: type) -> tuple:
    """What an ops class computes: for every method (private helpers too), the class that defines
    it. Two ops classes with equal ``ops_code`` run the same code; declarations (tuples such as
    ``attention_backends``) are left out, they are checked per device."""
    code = []
    for name in dir(ops_class):
        if name.startswith("__"):
            continue
        value = inspect.getattr_static(ops_class, name)
        if isinstance(value, (staticmethod, classmethod, property)) or inspect.isfunction(value):
            definer = next(k for k in ops_class.__mro__ if name in vars(k))
            code.append((name, f"{definer.__module__}.{definer.__qualname__}"))
    return tuple(code)


def _chips_by_ops_code(manager) -> dict[tuple, list]:
    groups: dict[tuple, list] = {}
    for name in CHIPS:
        device = manager.devices.get(name)
        groups.setdefault(ops_code(device.ops_class), []).append(device)
    return groups


def test_ops_code_tells_an_override_apart(manager):
    """The grouping below may merge two chips only when their ops run the same code."""
    from fd_nvidia.ops import NvidiaOps

    class OwnSilu(NvidiaOps):
        def silu_and_mul(self, x):
            return super().silu_and_mul(x)

    class OwnBackends(NvidiaOps):
        attention_backends = ("paged_reference",)

    assert ops_code(NvidiaOps) == ops_code(FusedOps) == ops_code(OwnBackends)
    differs = {a for a, b in zip(ops_code(OwnSilu), ops_code(NvidiaOps)) if a != b}
    assert differs == {("silu_and_mul", f"{__name__}.{OwnSilu.__qualname__}")}


def test_kit_passes_once_per_distinct_chip_ops_code_on_the_cpu_place(manager):
    """Ops, paged attention (every backend one of the chips declares), generation and every
    declared quantization method, once per distinct ops code: today all seven chips add only
    declarations to ``FusedOps``, so this is one run, not seven of the same code."""
    groups = _chips_by_ops_code(manager)
    assert sum(len(g) for g in groups.values()) == len(CHIPS)
    for devices in groups.values():
        targets = [checks.make_target(d, place="cpu") for d in devices]
        backends = {b: t for t in targets for b in t.device.attention_backends}
        methods = {m: t for t in targets for m in t.device.quantization_methods}
        skipped = _run_all_checks(
            targets[0],
            backends=[(t, b) for b, t in sorted(backends.items())],
            methods=[(t, m) for m, t in sorted(methods.items())],
        )
        # Only the memory check needs the chip; every declared method is registered and ran.
        assert skipped == [f"{devices[0].name} is not available here, so its memory cannot be read"], skipped


_KERNEL_CHOICE = re.compile(r"^(?:fused (\S+)|reference \(no (\S+) kernel for .+\))$")


def _kernels_asked(device) -> dict[str, set[str]]:
    """Every op of the kit run once through ``device``'s ops class on the CPU place in float32;
    kernel name -> what the ops chose ("fused" / "reference") each time they asked for it."""
    made = []

    class Recording(device.ops_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    target = checks.make_target(device, ops_class=Recording, place="cpu")
    for op in checks.OPS:
        checks.check_op(target, op, "float32")
    asked: dict[str, set[str]] = {}
    for ops in made:
        for choice in ops.kernel_choices.values():
            fused, missing = _KERNEL_CHOICE.match(choice).groups()
            asked.setdefault(fused or missing, set()).add("fused" if fused else "reference")
    return asked


@pytest.mark.parametrize("name", CHIPS)
def test_what_each_chip_declares_is_what_its_ops_and_the_registry_offer(manager, name):
    """Per chip: its declaration and attention backend selection; its dtypes (only float32 can be
    computed on the CPU place); each declared quantization method is registered (so the run above
    executed it instead of skipping); each expected kernel is one its ops really ask Paddle's
    registry for, and ran fused wherever this Paddle registers it for CPU float32."""
    from fastdeploy_core.plugins import get_plugin_manager

    device = manager.devices.get(name)
    target = checks.make_target(device, place="cpu")
    assert target.ops_class is device.ops_class and not target.on_device
    assert target.dtypes == ("float32",) and "float32" in device.supported_dtypes
    checks.check_declaration(target)
    checks.check_attention_backend_selection(target)
    checks.check_detection(target)
    with pytest.raises(checks.CheckSkipped, match="memory cannot be read"):
        checks.check_memory_info(target)
    registered = set(get_plugin_manager().quantizers.keys())
    assert set(device.quantization_methods) <= registered, (
        f"{name} declares {sorted(set(device.quantization_methods) - registered)}, which no plugin registers"
    )
    expected = device.ops_class.expected_kernels
    if not expected:
        with pytest.raises(checks.CheckSkipped, match="declares no expected_kernels"):
            checks.check_expected_kernels(target)
        return
    with pytest.raises(checks.CheckSkipped, match="kernels of the chip not checkable"):
        checks.check_expected_kernels(target)
    asked = _kernels_asked(device)
    assert set(expected) <= set(asked), f"{name} expects {sorted(set(expected) - set(asked))}, which no op asks for"
    from fastdeploy_core.devices.host_cpu import PADDLE_AVX512_ONLY_CPU_KERNELS, has_avx512f

    # Registered for the CPU, and runnable here (Paddle's CPU fused_rms_norm needs AVX-512).
    on_cpu = {
        k
        for k in expected
        if ("cpu", "float32") in registered_kernels().get(k, ())
        and (has_avx512f() or k not in PADDLE_AVX512_ONLY_CPU_KERNELS)
    }
    for kernel in expected:
        assert asked[kernel] == ({"fused"} if kernel in on_cpu else {"reference"}), (kernel, asked[kernel])


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


def test_example_plugin_passes_and_its_broken_op_fails(example_chip_on_path):
    good = _kit("--fd-device=example_chip")
    assert good.returncode == 0, good.stdout[-3000:]
    broken = _kit("--fd-device=example_chip", "--fd-ops-class=fd_example_chip.ops:BrokenExampleOps")
    assert broken.returncode == 1, broken.stdout[-3000:]
    assert "FAILED" in broken.stdout and "test_op_parity[float32-rms_norm]" in broken.stdout
    assert "rms_norm output 0 [float32]: max abs error" in broken.stdout
    # docs/writing-a-plugin.md shows the end of this very run: every line of it but the timing
    shown = _doc_block_after("After each failure's traceback")
    assert shown[0].startswith("=") and "3 failed" in shown[-1], shown
    printed = broken.stdout.splitlines()
    for line in shown[:-1]:
        # on a CI machine (CI or BUILD_NUMBER set) pytest appends each failure's message to its
        # FAILED line whatever the width; a terminal shows the line as the guide does
        assert any(out == line or out.startswith(line + " - ") for out in printed), line
    assert "np.int64" not in broken.stdout and "\nFAILED ::" not in broken.stdout


def _doc_block_after(marker: str) -> list[str]:
    """The lines of the first fenced block after ``marker`` in docs/writing-a-plugin.md."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "writing-a-plugin.md").read_text(encoding="utf-8")
    after = doc[doc.index(marker) :]
    return after.split("```\n", 2)[1].strip("\n").splitlines()


def test_the_guides_ops_snippet_runs_as_written(manager):
    """The ``MyChipOps`` snippet of the plugin guide, as printed: its imports resolve and, without
    the vendor kernel, ``silu_and_mul`` falls back to the reference."""
    import numpy as np
    import paddle

    from fastdeploy_core.devices.reference_ops import ReferenceOps

    doc = (Path(__file__).resolve().parents[2] / "docs" / "writing-a-plugin.md").read_text(encoding="utf-8")
    snippet = doc[doc.index("class MyChipOps(FusedOps)") :]
    snippet = doc[: doc.index("class MyChipOps(FusedOps)")].rsplit("```python\n", 1)[1] + snippet.split("```", 1)[0]
    namespace: dict = {}
    exec(textwrap.dedent(snippet), namespace)  # noqa: S102 - the guide's own code
    ops = namespace["MyChipOps"]()
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((3, 8)).astype("float32"))
    np.testing.assert_allclose(ops.silu_and_mul(x).numpy(), ReferenceOps().silu_and_mul(x).numpy(), rtol=1e-6)


def test_pytest_plugin_fails_for_an_unavailable_device_unless_asked_for_cpu_paths():
    proc = _kit("--fd-device=metax_gpu")
    assert proc.returncode != 0 and "no custom device 'metax_gpu' loaded" in proc.stdout
    unknown = _kit("--fd-device=no_such_chip")
    assert unknown.returncode != 0 and "no installed plugin registers it" in unknown.stderr
