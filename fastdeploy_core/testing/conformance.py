"""The conformance kit's tests; collected by :mod:`fastdeploy_core.testing.pytest_plugin` with ``--fd-device``.

Each test wraps one check of :mod:`fastdeploy_core.testing.checks`; a check that cannot run
here is skipped with its reason, any other difference fails with what differed and by how much.
"""

from __future__ import annotations

import contextlib

import pytest

from fastdeploy_core.testing import checks


@contextlib.contextmanager
def _skippable():
    try:
        yield
    except checks.CheckSkipped as exc:
        pytest.skip(str(exc))


def test_declaration(fd_target):
    checks.check_declaration(fd_target)


def test_attention_backend_selection(fd_target):
    checks.check_attention_backend_selection(fd_target)


def test_detection(fd_target):
    checks.check_detection(fd_target)


def test_memory_info(fd_target):
    with _skippable():
        checks.check_memory_info(fd_target)


def test_expected_kernels(fd_target):
    with _skippable():
        checks.check_expected_kernels(fd_target)


def test_op_parity(fd_target, fd_op, fd_dtype):
    checks.check_op(fd_target, fd_op, fd_dtype)


def test_paged_attention_parity(fd_target, fd_scenario, fd_backend, fd_dtype):
    checks.check_paged_attention(fd_target, fd_scenario, fd_backend, fd_dtype)


def test_rope_paged_attention_parity(fd_target, fd_scenario, fd_backend, fd_dtype):
    checks.check_rope_paged_attention(fd_target, fd_scenario, fd_backend, fd_dtype)


def test_bf16_kv_cache_parity(fd_target, fd_scenario, fd_backend):
    checks.check_bf16_kv_cache(fd_target, fd_scenario, fd_backend)


def test_mla_paged_attention_parity(fd_target, fd_scenario, fd_backend, fd_dtype):
    checks.check_mla_paged_attention(fd_target, fd_scenario, fd_backend, fd_dtype)


def test_greedy_generation_matches_cpu(fd_target):
    with _skippable():
        checks.check_generation(fd_target)


def test_quantization_method(fd_target, fd_method):
    if fd_method == "<none declared>":
        pytest.skip(f"{fd_target.device.name} declares no quantization methods")
    with _skippable():
        checks.check_quantization_method(fd_target, fd_method)
