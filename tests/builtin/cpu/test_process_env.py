"""The cpu device's process settings: filled in once, never overriding the user's, former names mapped."""

import os
import subprocess
import sys

import pytest

from fastdeploy_core.builtin.cpu import process_env
from fastdeploy_core.builtin.cpu.process_env import configure_process_env, kernels_disabled
from fastdeploy_core.devices.host_cpu import cpu_flags


def test_thread_count_defaults_to_the_usable_cores_and_keeps_a_users_value():
    env: dict[str, str] = {}
    configure_process_env(env)
    assert env["OMP_NUM_THREADS"] == str(process_env.usable_cores())
    env = {"OMP_NUM_THREADS": "7"}
    configure_process_env(env)
    assert env["OMP_NUM_THREADS"] == "7"


def test_mkl_cpu_type_is_set_on_amd_only(monkeypatch):
    for amd in (True, False):
        monkeypatch.setattr(process_env, "is_amd_cpu", lambda amd=amd: amd)
        env: dict[str, str] = {}
        configure_process_env(env)
        assert ("MKL_DEBUG_CPU_TYPE" in env) is amd
        assert env.get("MKL_DEBUG_CPU_TYPE", "5") == "5"


@pytest.mark.parametrize(
    ("old", "value", "new", "expected"),
    [
        ("FD_DISABLE_QUANT_KERNELS", "1", "FD_CPU_KERNELS", "0"),
        ("FD_DISABLE_QUANT_KERNELS", "0", "FD_CPU_KERNELS", "1"),
        ("FD_QUANT_KERNEL_THREADS", "3", "FD_CPU_KERNEL_THREADS", "3"),
        ("FD_QUANT_KERNEL_SPIN", "50", "FD_CPU_KERNEL_SPIN", "50"),
    ],
)
def test_former_names_still_work_with_a_warning(old, value, new, expected):
    env = {old: value}
    with pytest.warns(FutureWarning, match=f"{old} is deprecated; set {new} instead"):
        configure_process_env(env)
    assert env[new] == expected


def test_the_current_name_wins_over_a_former_one():
    env = {"FD_DISABLE_QUANT_KERNELS": "1", "FD_CPU_KERNELS": "1"}
    with pytest.warns(FutureWarning):
        configure_process_env(env)
    assert not kernels_disabled(env)


@pytest.mark.parametrize(
    ("env", "disabled"),
    [({}, False), ({"FD_CPU_KERNELS": "0"}, True), ({"FD_CPU_KERNELS": "1"}, False), ({"FD_DISABLE_QUANT_KERNELS": "1"}, True)],
)
def test_kernels_disabled(env, disabled):
    assert kernels_disabled(env) is disabled


def _python(code: str, threads: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=threads, FD_CPU_KERNELS="1")  # the kernels on any CPU
    cmd = [sys.executable, "-c", code]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env)


_OMP_THREADS = (
    "import ctypes, glob, os, paddle; "
    "lib = glob.glob(os.path.join(os.path.dirname(paddle.__file__), 'libs', 'libiomp5.so')); "
    "print(os.environ['OMP_NUM_THREADS'], ctypes.CDLL(lib[0]).omp_get_max_threads() if lib else 'n/a')"
)


def test_paddle_imports_without_its_thread_warning_and_keeps_the_thread_count():
    plain = _python(_OMP_THREADS, "3")  # Paddle alone warns: the check below can fail
    assert "PLEASE USE OMP_NUM_THREADS WISELY" in plain.stderr
    quiet = _python("import fastdeploy_core; " + _OMP_THREADS, "3")
    assert quiet.returncode == 0, quiet.stderr
    assert "OMP_NUM_THREADS" not in quiet.stderr, quiet.stderr
    assert quiet.stdout.split() in (["3", "3"], ["3", "n/a"]), quiet.stdout


def test_loading_the_kernels_logs_nothing_from_paddle():
    code = (
        "import logging; logging.basicConfig(level=logging.INFO); "
        "from fastdeploy_core.builtin.cpu.kernels import load_kernels, kernel_failure; "
        "assert load_kernels() is not None, kernel_failure()"
    )
    proc = _python(code, "1")
    assert proc.returncode == 0, proc.stderr
    assert "custom operator" not in proc.stderr, proc.stderr


# The choice sees the CPU without the stripped flags; the library's name is pinned to this CPU's
# first (it hashes the flags, and a -march=native build of this machine is the same binary
# whatever the choice saw): a subprocess that loads the kernels reuses the suite's build instead
# of compiling its own copy (~3.5 minutes each on 2 cores). It prints whether the choice saw
# vectors that fit, so the test also checks that the flags were hidden from it.
_CHOICE = (
    "import fastdeploy_core.builtin.cpu.kernels as k; "
    "import fastdeploy_core.devices.host_cpu as h; "
    "name = k.library_name(); k.library_name = lambda: name; "
    "flags = h.cpu_flags(); "
    "h.cpu_flags = lambda: frozenset(f for f in flags if not f.startswith({strip!r})); "
    "print('RESULT', k.load_kernels() is not None, k.kernel_vectors_fit(), k.kernel_failure())"
)

# Flags hidden from the subprocess: those starting with one of these prefixes.
_NO_AVX512 = ("avx512",)
_NO_WIDE_VECTORS = ("avx512", "avx2", "fma")


@pytest.mark.parametrize(
    ("strip", "env", "loaded"),
    [
        (_NO_WIDE_VECTORS, None, False),
        (_NO_WIDE_VECTORS, "1", True),
        (_NO_WIDE_VECTORS, "0", False),
        (_NO_AVX512, None, None),
        ((), None, None),
    ],
    ids=["no_avx2_default", "no_avx2_forced", "no_avx2_disabled", "no_avx512_default", "this_cpu_default"],
)
def test_kernels_are_chosen_by_default_with_avx512_or_avx2(strip, env, loaded):
    """A CPU with neither AVX-512 nor AVX2 + FMA runs Paddle's ops unless FD_CPU_KERNELS=1, and the
    reason is stated; AVX2 + FMA is enough (the kernels' vectors are register pairs there)."""
    flags = cpu_flags()

    environ = {k: v for k, v in os.environ.items() if k != "FD_CPU_KERNELS"}
    if env is not None:
        environ["FD_CPU_KERNELS"] = env
    done = subprocess.run(
        [sys.executable, "-c", _CHOICE.format(strip=strip)], capture_output=True, text=True, timeout=600, env=environ
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")][-1]
    kept = {f for f in flags if not f.startswith(strip)}
    fit = "avx512f" in kept or {"avx2", "fma"} <= kept  # what is left of this machine's flags
    if loaded is None:  # this machine's own choice
        loaded = fit
    assert line.startswith(f"RESULT {loaded} {fit}"), line
    if strip == _NO_WIDE_VECTORS and env is None:
        assert "neither AVX-512 nor AVX2 with FMA" in line and "FD_CPU_KERNELS=1 uses the kernels anyway" in line
