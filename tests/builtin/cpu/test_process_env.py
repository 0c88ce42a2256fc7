"""The cpu device's process settings: filled in once, never overriding the user's, former names mapped."""

import pytest

from fastdeploy_core.builtin.cpu import process_env
from fastdeploy_core.builtin.cpu.process_env import configure_process_env, kernels_disabled


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
