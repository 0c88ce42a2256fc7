"""PaddleFormers' mixture-of-experts blocks replaced by the core's :class:`SparseMoeBlock`.

PaddleFormers' MoE blocks run each expert as its own small MLP in a Python loop (0.4's
Qwen3-MoE), or dispatch through fused ops that have no CPU kernel (ERNIE-4.5-MoE's
``moe_gate_dispatch_partial_nosoftmaxtopk``). The fallback swaps each for the core block the
native models use (one routing + the device's ``fused_moe`` op), configured from the
checkpoint's config the way each family routes (DeepSeek-V3's group-limited sigmoid routing:
the core ``GroupedTopkRouter`` with ``FusedMoE``), and loads HF's expert tensors into it. A
family with a router the core block does not implement is refused rather than served wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle
from paddle import nn

from fastdeploy_core.layers.moe import FusedMoE, GroupedTopkRouter, SparseMoeBlock


@dataclass
class RouterSpec:
    """How one family's router picks and weighs experts, read from its HF config."""

    num_experts: int
    top_k: int
    width: int
    scoring: str = "softmax"
    renormalize: bool = False
    norm_min: float = 0.0
    correction_bias: bool = False
    #: HF name of the correction bias under the block's prefix, when it is stored elsewhere
    bias_source: str = "e_score_correction_bias"
    #: group-limited routing (DeepSeek-V3): experts in ``num_groups`` groups, a token picks among
    #: the best ``topk_group``; 0 for plain top-k routing
    num_groups: int = 0
    topk_group: int = 0
    routed_scaling_factor: float = 1.0

    @property
    def bias_dest(self) -> str:
        """Where the correction bias lives under the core block (the grouped router keeps its own)."""
        return "gate.e_score_correction_bias" if self.num_groups else "e_score_correction_bias"


def router_spec(family: str, hf_config: dict) -> RouterSpec | None:
    """The router of ``family``'s MoE layers, ``None`` when the core block does not implement it."""
    if family == "Qwen3Moe":
        return RouterSpec(
            num_experts=int(hf_config.get("num_experts") or hf_config["num_local_experts"]),
            top_k=int(hf_config["num_experts_per_tok"]),
            width=int(hf_config["moe_intermediate_size"]),
            renormalize=bool(hf_config.get("norm_topk_prob", False)),
        )
    if family == "Ernie4_5_Moe":
        return RouterSpec(
            num_experts=int(hf_config["moe_num_experts"]),
            top_k=int(hf_config["moe_k"]),
            width=int(hf_config["moe_intermediate_size"]),
            renormalize=True,
            norm_min=float(hf_config.get("moe_norm_min", 1e-12)),
            correction_bias=True,
            bias_source="moe_statics.e_score_correction_bias",
        )
    if family == "DeepseekV3":
        scoring = str(hf_config.get("scoring_func", "sigmoid"))
        if scoring != "sigmoid" or hf_config.get("topk_method", "noaux_tc") != "noaux_tc":
            return None
        return RouterSpec(
            num_experts=int(hf_config["n_routed_experts"]),
            top_k=int(hf_config["num_experts_per_tok"]),
            width=int(hf_config["moe_intermediate_size"]),
            scoring="sigmoid",
            renormalize=bool(hf_config.get("norm_topk_prob", True)),
            correction_bias=True,
            bias_source="gate.e_score_correction_bias",
            num_groups=int(hf_config.get("n_group") or 1),
            topk_group=int(hf_config.get("topk_group") or 1),
            routed_scaling_factor=float(hf_config.get("routed_scaling_factor", 1.0)),
        )
    return None


class GroupedMoe(nn.Layer):
    """Group-limited routed experts (the core ``GroupedTopkRouter`` + ``FusedMoE``) plus
    PaddleFormers' shared experts, behind its ``[batch, T, H]`` decoder-layer call."""

    def __init__(self, spec: RouterSpec, hidden_size: int, shared_experts: nn.Layer | None, quant_config, prefix: str):
        super().__init__()
        self.top_k = spec.top_k
        self.gate = GroupedTopkRouter(
            hidden_size,
            spec.num_experts,
            spec.top_k,
            spec.num_groups,
            spec.topk_group,
            renormalize=spec.renormalize,
            routed_scaling_factor=spec.routed_scaling_factor,
            correction_bias=spec.correction_bias,
            scoring=spec.scoring,
            prefix=f"{prefix}.gate",
        )
        self.experts = FusedMoE(spec.num_experts, hidden_size, spec.width, quant_config, prefix=f"{prefix}.experts")
        self.shared_experts = shared_experts

    def forward(self, hidden: paddle.Tensor) -> paddle.Tensor:
        shape = hidden.shape
        x = hidden.reshape([-1, shape[-1]])
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(shape)


class BatchedMoe(SparseMoeBlock):
    """The core block behind PaddleFormers' ``[batch, T, H]`` decoder-layer call.

    Its children keep PaddleFormers' (and HF's) names under the MLP slot: ``gate``, ``experts``,
    ``shared_experts`` (PaddleFormers' own shared MLP, whose linears are swapped like any other).
    """

    def forward(self, hidden: paddle.Tensor) -> paddle.Tensor:
        shape = hidden.shape
        return super().forward(hidden.reshape([-1, shape[-1]])).reshape(shape)


def is_moe_block(layer: nn.Layer) -> bool:
    """PaddleFormers' MoE blocks are the MLP slots holding a list of experts and a router."""
    return isinstance(getattr(layer, "experts", None), nn.LayerList) and hasattr(layer, "gate")


def checkpoint_sources(spec: RouterSpec, hf_prefix: str, dest_prefix: str) -> list[tuple[str, str, object, bool]]:
    """``(checkpoint name, parameter, shard, checkpoint is [out, in])`` for one swapped block."""
    out = [(f"{hf_prefix}.gate.weight", f"{dest_prefix}.gate.weight", None, True)]
    for expert in range(spec.num_experts):
        for part, param in (("gate_proj", "w13_weight"), ("up_proj", "w13_weight"), ("down_proj", "w2_weight")):
            out.append(
                (f"{hf_prefix}.experts.{expert}.{part}.weight", f"{dest_prefix}.experts.{param}", (expert, part), True)
            )
    if spec.correction_bias:
        out.append((f"{hf_prefix}.{spec.bias_source}", f"{dest_prefix}.{spec.bias_dest}", None, False))
    return out


def make_block(
    spec: RouterSpec, hidden_size: int, shared_experts: nn.Layer | None, quant_config, prefix: str
) -> nn.Layer:
    """The core block for ``spec``; ``quant_config`` stores its experts as the native MoE models' are."""
    if spec.num_groups:
        return GroupedMoe(spec, hidden_size, shared_experts, quant_config, prefix)
    return BatchedMoe(
        hidden_size,
        spec.num_experts,
        spec.top_k,
        spec.width,
        scoring=spec.scoring,
        renormalize=spec.renormalize,
        norm_min=spec.norm_min,
        correction_bias=spec.correction_bias,
        shared_experts=shared_experts,
        quant_config=quant_config,
        prefix=prefix,
    )
