"""Which of a PaddleFormers model's linears split across tensor-parallel ranks, and how.

PaddleFormers declares the same plan in its own modules (``tp_plan="colwise"`` for the Q/K/V and
gate/up projections, ``"rowwise"`` for the output and down projections) but builds plain
``nn.Linear`` without its tensor parallelism, so the plan is read back from the modules' names:

* an attention module with exactly ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` linears
  keeps this rank's heads (:func:`~fastdeploy_core.layers.parallel.head_share`): the three
  column-parallel on the heads' rows, ``o_proj`` row-parallel on their inputs. PaddleFormers
  reshapes Q/K/V with ``-1`` heads, so it attends over whatever heads the rank has;
* an MLP with ``gate_proj``, ``up_proj`` and ``down_proj`` linears (the fallback may merge the
  first two afterwards) keeps a share of the intermediate features, the same on both sides.

Anything else (latent attention, fused QKV or up-gate projections, experts) stays whole on every rank, which is
correct (each rank computes the same) but holds the whole weight. With one rank the plan is empty.
"""

from __future__ import annotations

from paddle import nn

from fastdeploy_core.layers.parallel import head_share, partition, split_unit, tp_group

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def parallel_plan(model: nn.Layer, num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, tuple[str, tuple]]:
    """``{linear path: ("column" | "row", (start, stop))}`` for the linears that split (paths as
    ``named_sublayers`` gives them); ``{}`` with one rank."""
    group = tp_group()
    if group.size == 1:
        return {}
    plan: dict[str, tuple[str, tuple]] = {}
    heads = None
    for path, layer in model.named_sublayers():
        children = layer._sub_layers  # noqa: SLF001 - the modules' own children by name
        if all(type(children.get(name)) is nn.Linear for name in ATTENTION_PROJECTIONS):
            heads = heads or head_share(num_heads, num_kv_heads)
            q = (heads.q_start * head_dim, heads.q_stop * head_dim)
            kv = (heads.kv_start * head_dim, heads.kv_stop * head_dim)
            plan[f"{path}.q_proj"] = ("column", q)
            plan[f"{path}.k_proj"] = ("column", kv)
            plan[f"{path}.v_proj"] = ("column", kv)
            plan[f"{path}.o_proj"] = ("row", q)
            continue
        down, gate, up = (children.get(name) for name in ("down_proj", "gate_proj", "up_proj"))
        if not all(type(linear) is nn.Linear for linear in (down, gate, up)):
            continue  # e.g. PaddleFormers' own fused up-gate projection: whole on every rank
        features = int(down.weight.shape[0])  # nn.Linear stores [in, out]
        share = partition(features, group.size, group.rank, split_unit(features, group.size))
        plan[f"{path}.gate_proj"] = ("column", share)
        plan[f"{path}.up_proj"] = ("column", share)
        plan[f"{path}.down_proj"] = ("row", share)  # the fallback's merged gate-up takes the same share
    return plan


def local_heads(num_heads: int, num_kv_heads: int, plan: dict) -> tuple[int, int]:
    """The heads one rank's attention computes: its share when attention splits, else all."""
    if not any(path.endswith(".q_proj") for path in plan):
        return num_heads, num_kv_heads
    heads = head_share(num_heads, num_kv_heads)
    return heads.num_heads, heads.num_kv_heads
