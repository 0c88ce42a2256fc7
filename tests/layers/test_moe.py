"""The mixture-of-experts layer: routing as transformers' Qwen3-MoE and ERNIE-4.5-MoE routers
compute it, and the kit's fused_moe check failing on a wrong expert computation."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fastdeploy_core.builtin.cpu.device import CpuDevice
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.layers.moe import select_experts
from fastdeploy_core.testing import checks

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _router_case(seed: int = 0):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((9, 16)).astype(np.float32)
    gate = rng.standard_normal((8, 16)).astype(np.float32)  # [E, H], HF layout
    bias = (0.3 * rng.standard_normal(8)).astype(np.float32)
    return hidden, gate, bias


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_softmax_top_k_matches_qwen3_moe_router(norm_topk_prob):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hidden, gate, _ = _router_case()
    config = transformers.Qwen3MoeConfig(
        hidden_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob
    )
    router = Qwen3MoeTopKRouter(config)
    router.weight.data = torch.tensor(gate)
    _, want_weights, want_ids = router(torch.tensor(hidden))
    logits = paddle.matmul(paddle.to_tensor(hidden), paddle.to_tensor(gate.T))
    weights, ids = select_experts(logits, 2, "softmax", renormalize=norm_topk_prob)
    np.testing.assert_array_equal(ids.numpy(), want_ids.numpy())
    np.testing.assert_allclose(weights.numpy(), want_weights.detach().numpy(), atol=1e-6)


def test_correction_bias_chooses_and_unbiased_scores_weigh_as_ernie_router():
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    hidden, gate, bias = _router_case(1)
    config = transformers.Ernie4_5_MoeConfig(hidden_size=16, moe_num_experts=8, moe_k=2)
    router = Ernie4_5_MoeTopKRouter(config)
    router.weight.data = torch.tensor(gate)
    router.moe_statics.e_score_correction_bias.data = torch.tensor(bias[None, :])
    _, want_weights, want_ids = router(torch.tensor(hidden))
    logits = paddle.matmul(paddle.to_tensor(hidden), paddle.to_tensor(gate.T))
    weights, ids = select_experts(logits, 2, "softmax", True, paddle.to_tensor(bias), norm_min=1e-12)
    np.testing.assert_array_equal(ids.numpy(), want_ids.numpy())
    np.testing.assert_allclose(weights.numpy(), want_weights.detach().numpy(), atol=1e-6)
    _, unbiased = select_experts(logits, 2, "softmax", True)
    assert not np.array_equal(unbiased.numpy(), ids.numpy()), "the bias must change some choice here"


def test_sigmoid_scores():
    logits = paddle.to_tensor(np.array([[0.0, 2.0, -1.0, 1.0]], dtype=np.float32))
    weights, ids = select_experts(logits, 2, "sigmoid")
    assert ids.numpy().tolist() == [[1, 3]]
    np.testing.assert_allclose(weights.numpy(), 1 / (1 + np.exp(-np.array([[2.0, 1.0]]))), rtol=1e-6)


class _WrongMoe(ReferenceOps):
    """Forgets the routing weights: the kit must notice."""

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids):
        return super().fused_moe(x, w13, w2, paddle.ones_like(topk_weights), topk_ids)


def test_kit_checks_fused_moe_and_can_fail():
    checks.check_op(checks.make_target(CpuDevice, ReferenceOps, "cpu"), "fused_moe", "float32")
    with pytest.raises(AssertionError, match="fused_moe output 0"):
        checks.check_op(checks.make_target(CpuDevice, _WrongMoe, "cpu"), "fused_moe", "float32")
