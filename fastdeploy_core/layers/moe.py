"""Mixture of experts: a router picks ``top_k`` of ``num_experts`` gated MLPs per token.

The routing (scores, top-k, renormalisation, correction bias) is a handful of plain Paddle
ops here, the same on every device; the expert computation is the ops table's one
``fused_moe`` op, which a device may replace with a grouped kernel. Expert weights are stored
stacked: ``w13 [E, H, 2I]`` (gate then up, Paddle's ``[in, out]`` layout) and ``w2 [E, I, H]``;
each checkpoint expert tensor (HF ``[out, in]``) is loaded into its slice.

Qwen3-MoE routes by softmax, top-k, optional renormalisation (``norm_topk_prob``); ERNIE-4.5
by softmax, top-k of the scores plus a correction bias (the bias picks the experts, the
unbiased scores weight them), renormalised with a floor (``moe_norm_min``), plus shared
experts every token goes through; DeepSeek-V3 by sigmoid with a correction bias, limited to the
best ``topk_group`` of ``n_group`` expert groups, renormalised and scaled by
``routed_scaling_factor`` (:func:`select_experts_grouped`, :class:`GroupedTopkRouter`).
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy_core.devices.current import current_ops
from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.layers.linear import Linear
from fastdeploy_core.layers.weights import as_float32, new_parameter, replace_parameter

SCORING_FUNCTIONS = ("softmax", "sigmoid")


def select_experts(
    router_logits: paddle.Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = False,
    correction_bias: paddle.Tensor | None = None,
    norm_min: float = 0.0,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """``router_logits [T, E]`` -> ``(weights float32 [T, k], expert ids int64 [T, k])``.

    Scores are ``softmax`` or ``sigmoid`` of the logits; the ``top_k`` experts are those of the
    largest ``scores + correction_bias`` (the bias only chooses), each weighted by its unbiased
    score; with ``renormalize`` the k weights are divided by their sum (at least ``norm_min``).
    """
    logits = router_logits.astype("float32")
    scores = F.softmax(logits, axis=-1) if scoring == "softmax" else F.sigmoid(logits)
    ranking = scores if correction_bias is None else scores + correction_bias
    _, ids = paddle.topk(ranking, top_k, axis=-1)
    weights = paddle.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        total = paddle.sum(weights, axis=-1, keepdim=True)
        weights = weights / (paddle.clip(total, min=norm_min) if norm_min > 0 else total)
    return weights, ids


def select_experts_grouped(
    router_logits: paddle.Tensor,
    top_k: int,
    num_groups: int,
    topk_group: int,
    correction_bias: paddle.Tensor | None = None,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Group-limited routing (DeepSeek-V3): ``router_logits [T, E]`` -> ``(weights float32 [T, k], ids int64 [T, k])``.

    The ``E`` experts form ``num_groups`` consecutive groups. A group is ranked by the sum of
    its two largest ``scores + correction_bias``; each token picks its ``top_k`` experts among
    the experts of its best ``topk_group`` groups only (so on a sharded deployment a token
    reaches few devices). Weights are the unbiased scores of the picked experts, divided by
    their sum (plus 1e-20) when ``renormalize``, then multiplied by ``routed_scaling_factor``.
    """
    num_experts = int(router_logits.shape[-1])
    if num_experts % num_groups:
        raise ModelLoadError(
            f"{num_experts} experts do not split into n_group={num_groups} equal groups; fix config.json"
        )
    per_group = num_experts // num_groups
    if per_group < 2 or not 0 < topk_group <= num_groups or top_k > topk_group * per_group:
        raise ModelLoadError(
            f"group-limited routing needs at least 2 experts per group and top_k {top_k} <= topk_group {topk_group} x "
            f"{per_group} experts per group with topk_group <= n_group {num_groups}; fix config.json"
        )
    logits = router_logits.astype("float32")
    scores = F.softmax(logits, axis=-1) if scoring == "softmax" else F.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias
    tokens = int(choice.shape[0])
    best_two, _ = paddle.topk(choice.reshape([tokens, num_groups, per_group]), 2, axis=-1)
    _, groups = paddle.topk(paddle.sum(best_two, axis=-1), topk_group, axis=-1)  # [T, topk_group]
    group_mask = paddle.put_along_axis(
        paddle.zeros([tokens, num_groups], dtype="float32"), groups, paddle.ones_like(groups, dtype="float32"), axis=1
    )
    expert_mask = paddle.repeat_interleave(group_mask, per_group, axis=1) > 0
    choice = paddle.where(expert_mask, choice, paddle.full_like(choice, float("-inf")))
    _, ids = paddle.topk(choice, top_k, axis=-1)
    weights = paddle.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / (paddle.sum(weights, axis=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids


class GroupedTopkRouter(nn.Layer):
    """The router of a group-limited MoE layer: ``forward(x [T, H]) -> (weights [T, k], ids [T, k])``.

    Parameters as HF names them under the layer's ``gate``: ``weight`` (``[E, H]`` in the
    checkpoint, kept ``[H, E]``) and ``e_score_correction_bias [E]``; float32 whatever the
    quantizer, because it is small and decides discretely. See :func:`select_experts_grouped`.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        num_groups: int,
        topk_group: int,
        renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        correction_bias: bool = True,
        scoring: str = "sigmoid",
        prefix: str = "",
    ):
        super().__init__()
        if scoring not in SCORING_FUNCTIONS:
            raise ModelLoadError(f"{prefix}: router scoring {scoring!r} is not one of {', '.join(SCORING_FUNCTIONS)}")
        if not 0 < top_k <= num_experts:
            raise ModelLoadError(
                f"{prefix}: {top_k} experts per token (num_experts_per_tok) of {num_experts} experts "
                "(n_routed_experts); it must be between 1 and the number of experts"
            )
        self.prefix = prefix
        self.hidden_size, self.num_experts = int(hidden_size), int(num_experts)
        self.top_k, self.num_groups, self.topk_group = int(top_k), int(num_groups), int(topk_group)
        self.renormalize = bool(renormalize)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.scoring = scoring
        # Checked here, at construction, so a bad config fails before any weight loads.
        select_experts_grouped(
            paddle.zeros([1, self.num_experts]), self.top_k, self.num_groups, self.topk_group, None, False
        )
        self.weight = new_parameter(self, [self.hidden_size, self.num_experts])
        self.weight.weight_loader = self._load_weight
        if correction_bias:
            self.e_score_correction_bias = new_parameter(self, [self.num_experts])
            self.e_score_correction_bias.weight_loader = self._load_bias
        else:
            self.e_score_correction_bias = None

    def _load_weight(self, param: paddle.Tensor, loaded, shard_id=None) -> None:
        array = as_float32(loaded)
        if tuple(array.shape) != (self.num_experts, self.hidden_size):
            raise ModelLoadError(
                f"{self.prefix}.weight: checkpoint tensor of shape {tuple(array.shape)}, the config (n_routed_experts, "
                f"hidden_size) implies {(self.num_experts, self.hidden_size)}; the checkpoint does not match its config.json"
            )
        param.set_value(array.T)

    def _load_bias(self, param: paddle.Tensor, loaded, shard_id=None) -> None:
        array = as_float32(loaded).reshape(-1)
        if array.shape[0] != self.num_experts:
            raise ModelLoadError(
                f"{self.prefix}.e_score_correction_bias has {array.shape[0]} entries, the config declares "
                f"{self.num_experts} experts (n_routed_experts)"
            )
        param.set_value(array)

    def forward(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        logits = current_ops().linear(x, self.weight)
        return select_experts_grouped(
            logits,
            self.top_k,
            self.num_groups,
            self.topk_group,
            self.e_score_correction_bias,
            self.renormalize,
            self.routed_scaling_factor,
            self.scoring,
        )


class FusedMoE(nn.Layer):
    """The routed experts of one layer: ``forward(x [T, H], weights [T, k], ids [T, k]) -> [T, H]``.

    Each expert is a SwiGLU MLP (``down(silu(gate(x)) * up(x))``) of width ``intermediate_size``.
    With a ``quant_config`` whose ``get_moe_method(layer, prefix)`` returns a method, that
    method stores the experts (``create_weights``), quantizes each checkpoint tensor as it loads
    (``load_expert``) and computes them (``apply``); else they are float32.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, quant_config=None, prefix: str = ""):
        super().__init__()
        self.num_experts = int(num_experts)
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
        self.prefix = prefix
        get_method = getattr(quant_config, "get_moe_method", None)
        self.quant_method = get_method(self, prefix) if get_method is not None else None
        if self.quant_method is not None:
            self.quant_method.create_weights(self)
            return
        self.w13_weight = new_parameter(self, [self.num_experts, self.hidden_size, 2 * self.intermediate_size])
        self.w2_weight = new_parameter(self, [self.num_experts, self.intermediate_size, self.hidden_size])
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader

    def checkpoint_shards(self) -> dict[str, int]:
        """How many checkpoint tensors fill each parameter: gate and up per expert, down per expert."""
        return {"w13_weight": 2 * self.num_experts, "w2_weight": self.num_experts}

    def weight_loader(self, param: paddle.Tensor, loaded, shard_id=None) -> None:
        """Load expert ``e``'s HF tensor: ``shard_id = (e, "gate_proj" | "up_proj" | "down_proj")``."""
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ModelLoadError(
                f"{self.prefix}.{expert}.{part}: the checkpoint has expert {expert}, the config declares "
                f"{self.num_experts} experts (num_experts / moe_num_experts); the checkpoint does not match its config.json"
            )
        array = as_float32(loaded)
        inter, hidden = self.intermediate_size, self.hidden_size
        expected = (hidden, inter) if part == "down_proj" else (inter, hidden)
        if tuple(array.shape) != expected:
            field = "moe_intermediate_size" if inter not in array.shape else "hidden_size"
            raise ModelLoadError(
                f"{self.prefix}.{expert}.{part}.weight: checkpoint tensor of shape {tuple(array.shape)}, the config "
                f"({field}) implies {expected}; the checkpoint does not match its config.json"
            )
        if self.quant_method is not None:
            start = inter if part == "up_proj" else 0
            self.quant_method.load_expert(self, "w2" if part == "down_proj" else "w13", expert, start, array.T)
            return
        value = paddle.to_tensor(array.T)
        if part == "down_proj":
            param[expert] = value
        elif part == "gate_proj":
            param[expert, :, :inter] = value
        else:
            param[expert, :, inter:] = value

    def process_weights_after_loading(self) -> None:
        """Let the device store float32 experts in the layout its ``fused_moe`` reads fastest
        (``prepare_expert_weight``; ``unprepare_linear_weight`` gives ``[E, in, out]`` back)."""
        if self.quant_method is not None:
            return
        for name in ("w13_weight", "w2_weight"):
            prepared = current_ops().prepare_expert_weight(getattr(self, name))
            if prepared is not None:
                replace_parameter(self, name, prepared)

    def forward(self, x: paddle.Tensor, weights: paddle.Tensor, ids: paddle.Tensor) -> paddle.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, weights, ids)
        return current_ops().fused_moe(x, self.w13_weight, self.w2_weight, weights, ids)


class SparseMoeBlock(nn.Layer):
    """Router (``gate``, a ``[H, E]`` linear), routed experts, optional shared experts.

    Args:
        shared_experts: a layer every token goes through, added to the routed output (ERNIE).
        correction_bias: whether the router has a per-expert ``e_score_correction_bias``.
        quant_config: stores the routed experts (see :class:`FusedMoE`); the router stays float32.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        scoring: str = "softmax",
        renormalize: bool = False,
        norm_min: float = 0.0,
        correction_bias: bool = False,
        shared_experts: nn.Layer | None = None,
        quant_config=None,
        prefix: str = "",
    ):
        super().__init__()
        if scoring not in SCORING_FUNCTIONS:
            raise ModelLoadError(f"{prefix}: router scoring {scoring!r} is not one of {', '.join(SCORING_FUNCTIONS)}")
        if not 0 < top_k <= num_experts:
            raise ModelLoadError(
                f"{prefix}: {top_k} experts per token (num_experts_per_tok / moe_k) of {num_experts} experts "
                "(num_experts / moe_num_experts); it must be between 1 and the number of experts"
            )
        self.top_k = int(top_k)
        self.scoring = scoring
        self.renormalize = bool(renormalize)
        self.norm_min = float(norm_min)
        # The router stays float32 whatever the quantizer: it is small and decides discretely.
        self.gate = Linear(hidden_size, num_experts, bias=False, quant_config=None, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, quant_config, prefix=f"{prefix}.experts")
        self.shared_experts = shared_experts
        if correction_bias:
            self.e_score_correction_bias = new_parameter(self, [num_experts])
            self.e_score_correction_bias.weight_loader = self._load_bias
        else:
            self.e_score_correction_bias = None

    def _load_bias(self, param: paddle.Tensor, loaded, shard_id=None) -> None:
        array = as_float32(loaded).reshape(-1)
        if array.shape[0] != param.shape[0]:
            raise ModelLoadError(
                f"router correction bias has {array.shape[0]} entries, the config declares {param.shape[0]} experts"
            )
        param.set_value(array)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        weights, ids = select_experts(
            self.gate(x), self.top_k, self.scoring, self.renormalize, self.e_score_correction_bias, self.norm_min
        )
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
