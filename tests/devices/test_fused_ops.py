"""FusedOps: the kernel-registry check decides fused vs reference, per place and dtype."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import pytest  # noqa: E402

from fastdeploy_core.devices import fused_ops, kernels  # noqa: E402
from fastdeploy_core.devices.fused_ops import FusedOps  # noqa: E402
from fastdeploy_core.devices.reference_ops import ReferenceOps  # noqa: E402
from fastdeploy_core.testing.checks import cos_sin_cache  # noqa: E402


def test_registry_answers_per_place_and_dtype():
    x32 = paddle.zeros([2], dtype="float32")
    x64 = paddle.zeros([2], dtype="float64")
    assert kernels.has_kernel("swiglu", x32)  # Paddle 3.3.1 CPU registers swiglu for float32 and float64
    assert kernels.has_kernel("swiglu", x64)
    assert not kernels.has_kernel("fused_rotary_position_embedding", x32)  # MEASURED.md: missing on CPU
    assert not kernels.has_kernel("no_such_kernel", x32)
    assert "cpu/float32" in kernels.kernel_places("fused_rms_norm_quant")


def test_choices_record_what_ran_on_cpu():
    ops = FusedOps()
    x = paddle.randn([3, 8])
    ops.rms_norm(x, paddle.ones([8]), 1e-6)
    ops.silu_and_mul(paddle.randn([3, 8]))
    ops.rotary_embedding(paddle.to_tensor([0, 1, 2]), paddle.randn([3, 2, 8]), None, paddle.to_tensor(cos_sin_cache(8, 4)))
    from fastdeploy_core.devices.host_cpu import has_avx512f

    if has_avx512f():
        assert ops.kernel_choices["rms_norm"] == "fused fused_rms_norm_quant"
    else:  # Paddle's CPU kernel is built for AVX-512 only (SIGILL elsewhere)
        assert ops.kernel_choices["rms_norm"] == "reference (no fused_rms_norm_quant kernel for cpu/float32)"
    assert ops.kernel_choices["silu_and_mul"] == "fused swiglu"
    assert ops.kernel_choices["rotary_embedding"] == "reference (no fused_rotary_position_embedding kernel for cpu/float32)"


def test_missing_kernel_falls_back_to_the_same_numbers(monkeypatch):
    monkeypatch.setattr(fused_ops, "has_kernel", lambda kernel, tensor: False)
    ops, ref = FusedOps(), ReferenceOps()
    rng = np.random.default_rng(0)
    x, r = paddle.to_tensor(rng.standard_normal((4, 16)).astype("float32")), paddle.to_tensor(rng.standard_normal((4, 16)).astype("float32"))
    w = paddle.to_tensor((1 + 0.1 * rng.standard_normal(16)).astype("float32"))
    np.testing.assert_allclose(ops.rms_norm(x, w, 1e-6).numpy(), ref.rms_norm(x, w, 1e-6).numpy(), rtol=1e-5, atol=1e-6)
    for got, want in zip(ops.add_rms_norm(x, r, w, 1e-6), ref.add_rms_norm(x, r, w, 1e-6)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    g = paddle.to_tensor(rng.standard_normal((4, 32)).astype("float32"))
    np.testing.assert_allclose(ops.silu_and_mul(g).numpy(), ref.silu_and_mul(g).numpy(), rtol=1e-5, atol=1e-6)
    assert all(choice.startswith("reference") for choice in ops.kernel_choices.values())


def _documented_fused_rope(q, k=None, v=None, sin=None, cos=None, position_ids=None, use_neox_rotary_style=True, **_):
    """Paddle's documented semantics of fused_rotary_position_embedding with use_neox_rotary_style=False:
    the front and back halves of head_dim are rotated as pairs (HF rotate_half); sin/cos [1, S, 1, d]."""
    assert not use_neox_rotary_style and position_ids is None and k is None and v is None
    assert list(sin.shape) == [1, q.shape[1], 1, q.shape[3]] == list(cos.shape)
    half = q.shape[-1] // 2
    rotated = paddle.concat([-q[..., half:], q[..., :half]], axis=-1)
    return q * cos + rotated * sin, None, None


def _rope_case():
    rng = np.random.default_rng(1)
    cache = paddle.to_tensor(cos_sin_cache(16, 64))
    pos = paddle.to_tensor(rng.integers(0, 64, size=9).astype("int64"))
    q = paddle.to_tensor(rng.standard_normal((9, 4, 16)).astype("float32"))
    k = paddle.to_tensor(rng.standard_normal((9, 2, 16)).astype("float32"))
    return pos, q, k, cache


def _assert_fused_rope_equals_reference():
    pos, q, k, cache = _rope_case()
    ops = FusedOps()
    got_q, got_k = ops.rotary_embedding(pos, q, k, cache)
    assert ops.kernel_choices["rotary_embedding"] == "fused fused_rotary_position_embedding"
    want_q, want_k = ReferenceOps().rotary_embedding(pos, q, k, cache)
    np.testing.assert_allclose(got_q.numpy(), want_q.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_k.numpy(), want_k.numpy(), rtol=1e-5, atol=1e-5)


def test_fused_rope_path_feeds_a_stand_in_of_the_documented_kernel(monkeypatch):
    """Not Paddle's kernel: the test's own stand-in, written from the kernel's documentation.
    It checks what the fused branch prepares (per-token sin/cos in the documented layout); the
    kernel itself runs in the next test wherever Paddle registers it."""
    monkeypatch.setattr(fused_ops, "_fused_rope", _documented_fused_rope)
    real_has_kernel = fused_ops.has_kernel
    monkeypatch.setattr(
        fused_ops, "has_kernel", lambda kernel, t: kernel == fused_ops.ROPE_KERNEL or real_has_kernel(kernel, t)
    )
    _assert_fused_rope_equals_reference()


def test_fused_rope_path_with_paddles_kernel():
    """Paddle's real fused_rotary_position_embedding, where its kernel registry has it for the place."""
    _, q, _, _ = _rope_case()
    if not fused_ops.has_kernel(fused_ops.ROPE_KERNEL, q):
        pytest.skip(f"Paddle {paddle.__version__} registers no {fused_ops.ROPE_KERNEL} kernel for {q.place}")
    _assert_fused_rope_equals_reference()
