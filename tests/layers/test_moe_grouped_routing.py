"""Group-limited routing as transformers' DeepSeek-V3 router computes it: sigmoid scores, a
correction bias that only chooses, the best ``topk_group`` of ``n_group`` groups, renormalised
and scaled weights."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.layers.moe import GroupedTopkRouter, select_experts, select_experts_grouped

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("restore_ops")


def _by_expert(weights: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's (ids, weights) sorted by expert id: transformers' top-k is unsorted."""
    order = np.argsort(ids, axis=-1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


def _hf_router(experts: int, groups: int, topk_group: int, top_k: int, norm: bool, scaling: float, gate, bias):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(
        hidden_size=gate.shape[1],
        n_routed_experts=experts,
        n_group=groups,
        topk_group=topk_group,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm,
        routed_scaling_factor=scaling,
    )
    router = DeepseekV3TopkRouter(config)
    router.weight.data = torch.tensor(gate)
    router.e_score_correction_bias.data = torch.tensor(bias)
    return router


@pytest.mark.parametrize(
    ("experts", "groups", "topk_group", "top_k", "norm", "scaling"),
    [(8, 2, 1, 2, True, 2.5), (8, 4, 2, 3, False, 1.0), (6, 2, 2, 4, True, 1.5), (16, 4, 3, 5, True, 2.0)],
)
def test_grouped_routing_matches_deepseek_v3_router(experts, groups, topk_group, top_k, norm, scaling):
    set_current_ops(ReferenceOps())
    rng = np.random.default_rng(experts * 10 + top_k)
    hidden = rng.standard_normal((33, 16)).astype(np.float32)
    gate = rng.standard_normal((experts, 16)).astype(np.float32)
    bias = (0.5 * rng.standard_normal(experts)).astype(np.float32)
    _, want_w, want_ids = _hf_router(experts, groups, topk_group, top_k, norm, scaling, gate, bias)(
        torch.tensor(hidden)
    )
    router = GroupedTopkRouter(16, experts, top_k, groups, topk_group, norm, scaling, prefix="mlp.gate")
    router._load_weight(router.weight, gate)
    router._load_bias(router.e_score_correction_bias, bias)
    weights, ids = router(paddle.to_tensor(hidden))
    got_ids, got_w = _by_expert(weights.numpy(), ids.numpy())
    ref_ids, ref_w = _by_expert(want_w.detach().numpy(), want_ids.numpy())
    np.testing.assert_array_equal(got_ids, ref_ids)
    np.testing.assert_allclose(got_w, ref_w, rtol=1e-6, atol=1e-7)
    # Only the best topk_group groups are ever chosen from.
    per_group = experts // groups
    assert all(len(set((row // per_group).tolist())) <= topk_group for row in got_ids)


def test_group_limit_bias_and_scaling_each_change_the_result():
    """Each option matters on this input, so the parity test above can fail."""
    rng = np.random.default_rng(3)
    logits = paddle.to_tensor(rng.standard_normal((64, 8)).astype(np.float32))
    bias = paddle.to_tensor((0.5 * rng.standard_normal(8)).astype(np.float32))
    w, ids = select_experts_grouped(logits, 2, 2, 1, bias, True, 2.5)
    _, ungrouped = select_experts_grouped(logits, 2, 2, 2, bias, True, 2.5)
    assert not np.array_equal(np.sort(ids.numpy(), -1), np.sort(ungrouped.numpy(), -1))
    _, unbiased = select_experts_grouped(logits, 2, 2, 1, None, True, 2.5)
    assert not np.array_equal(np.sort(ids.numpy(), -1), np.sort(unbiased.numpy(), -1))
    np.testing.assert_allclose(w.numpy().sum(-1), 2.5, rtol=1e-6)
    # With one group holding everything and no bias, it is plain sigmoid top-k (renormalised).
    plain_w, plain_ids = select_experts(logits, 2, "sigmoid", renormalize=True)
    one_w, one_ids = select_experts_grouped(logits, 2, 1, 1, None, True, 1.0)
    np.testing.assert_array_equal(one_ids.numpy(), plain_ids.numpy())
    np.testing.assert_allclose(one_w.numpy(), plain_w.numpy(), rtol=1e-6)


def test_inconsistent_groups_are_load_errors():
    with pytest.raises(ModelLoadError, match="n_group=3"):
        GroupedTopkRouter(16, 8, 2, 3, 1)
    with pytest.raises(ModelLoadError, match="top_k 5 <= topk_group 1"):
        GroupedTopkRouter(16, 8, 5, 2, 1)
    router = GroupedTopkRouter(16, 8, 2, 2, 1, prefix="model.layers.1.mlp.gate")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.gate\.weight.*\(8, 16\)"):
        router._load_weight(router.weight, np.zeros((4, 16), np.float32))
