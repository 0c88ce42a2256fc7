"""``fd_fused_moe`` (csrc/moe.cc) against ``ReferenceOps.fused_moe``, plain and packed experts."""

import numpy as np
import paddle
import pytest

from fastdeploy_core.builtin.cpu.ops import CpuOps
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.layers.moe import select_experts
from fastdeploy_core.plugins import load_plugins
from fastdeploy_core.testing import checks


def _case(rng, tokens, experts, hidden, inter, top_k, renormalize):
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    w13 = (rng.standard_normal((experts, hidden, 2 * inter)) / np.sqrt(hidden)).astype(np.float32)
    w2 = (rng.standard_normal((experts, inter, hidden)) / np.sqrt(inter)).astype(np.float32)
    logits = paddle.to_tensor(rng.standard_normal((tokens, experts)).astype(np.float32))
    weights, ids = select_experts(logits, top_k, "softmax", renormalize)
    return paddle.to_tensor(x), paddle.to_tensor(w13), paddle.to_tensor(w2), weights, ids


@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("experts,top_k,renormalize", [(4, 1, False), (8, 2, True), (8, 2, False), (6, 2, True)])
def test_kernel_matches_the_reference_plain_and_packed(tokens, experts, top_k, renormalize, cpu_kernels):
    rng = np.random.default_rng(tokens * 100 + experts * 10 + top_k)
    # hidden 64, intermediate 48: w13 packs (96 columns), w2 packs (64); the plain path also pads
    x, w13, w2, weights, ids = _case(rng, tokens, experts, 64, 48, top_k, renormalize)
    want = ReferenceOps().fused_moe(x, w13, w2, weights, ids).numpy()
    ops = CpuOps()
    plain = ops.fused_moe(x, w13, w2, weights, ids).numpy()
    p13, p2 = ops.prepare_expert_weight(w13), ops.prepare_expert_weight(w2)
    assert p13 is not None and list(p13.shape) == [experts, 3, 64, 32]
    assert list(p2.shape) == [experts, 2, 48, 32]
    packed = ops.fused_moe(x, p13, p2, weights, ids).numpy()
    np.testing.assert_allclose(plain, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(packed, want, rtol=1e-4, atol=1e-5)
    # The packed layout gives the plain experts back, as the quantizers' formulas read them.
    np.testing.assert_array_equal(ops.unprepare_linear_weight(p13).numpy(), w13.numpy())
    np.testing.assert_array_equal(ops.unprepare_linear_weight(p2).numpy(), w2.numpy())


def test_widths_that_are_not_whole_tiles_run_plain_and_padded(cpu_kernels):
    """intermediate 24 (w13 48 columns: one tile and a half) and hidden 40: no packed layout."""
    rng = np.random.default_rng(3)
    x, w13, w2, weights, ids = _case(rng, 9, 5, 40, 24, 2, True)
    ops = CpuOps()
    assert ops.prepare_expert_weight(w13) is None and ops.prepare_expert_weight(w2) is None
    want = ReferenceOps().fused_moe(x, w13, w2, weights, ids).numpy()
    np.testing.assert_allclose(ops.fused_moe(x, w13, w2, weights, ids).numpy(), want, rtol=1e-4, atol=1e-5)


def test_each_choice_is_weighted_by_its_own_weight(cpu_kernels):
    """One token, two experts with weights 1 and 0: the output is the first expert's alone."""
    rng = np.random.default_rng(5)
    x, w13, w2, _, _ = _case(rng, 1, 4, 32, 32, 2, False)
    ids = paddle.to_tensor(np.array([[2, 0]], dtype=np.int64))
    only_first = CpuOps().fused_moe(x, w13, w2, paddle.to_tensor(np.array([[1.0, 0.0]], np.float32)), ids).numpy()
    alone = ReferenceOps().fused_moe(
        x, w13, w2, paddle.to_tensor(np.array([[1.0]], np.float32)), paddle.to_tensor(np.array([[2]], np.int64))
    )
    np.testing.assert_allclose(only_first, alone.numpy(), rtol=1e-5, atol=1e-6)


def test_kernel_rejects_expert_ids_out_of_range(cpu_kernels):
    rng = np.random.default_rng(7)
    x, w13, w2, weights, _ = _case(rng, 2, 4, 32, 32, 2, False)
    ids = paddle.to_tensor(np.array([[0, 1], [2, 4]], dtype=np.int64))
    with pytest.raises(Exception, match=r"expert id 4 \(token 1\) is outside \[0, 4\)"):
        CpuOps().fused_moe(x, w13, w2, weights, ids)


def test_conformance_check_runs_the_kernel_and_catches_a_wrong_one(cpu_kernels):
    """The kit's fused_moe check passes on CpuOps (plain experts, I = 24: the kernel's padded
    path) and fails for a table whose kernel call swaps the weights of the two choices."""
    cpu = load_plugins().devices.get("cpu")
    checks.check_op(checks.make_target(cpu), "fused_moe", "float32")

    class SwappedChoices(CpuOps):
        def fused_moe(self, x, w13, w2, topk_weights, topk_ids):
            return super().fused_moe(x, w13, w2, topk_weights.flip(axis=[1]), topk_ids)

    with pytest.raises(AssertionError, match="fused_moe output 0"):
        checks.check_op(checks.make_target(cpu, ops_class=SwappedChoices), "fused_moe", "float32")
