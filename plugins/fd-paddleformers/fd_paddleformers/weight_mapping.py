"""Checkpoint tensor -> PaddleFormers parameter, read from PaddleFormers' own mapping declaration.

Every PaddleFormers model class declares how HF checkpoint tensors become its parameters in
``_gen_aoa_config(config)``: a list of "AOA" statements such as::

    model.layers.$LAYER_ID.self_attn.o_proj.weight^T -> layers.$LAYER_ID.self_attn.o_proj.weight
    model.layers.$LAYER_ID.self_attn.q_proj.weight^T, ...k_proj.weight^T, ...v_proj.weight^T
        -> layers.$LAYER_ID.self_attn.qkv_proj.weight, fused_qkv, num_heads=8, num_key_value_groups=2
    model.layers.$LAYER_ID.mlp.gate_proj.weight^T, ...up_proj.weight^T -> layers.$LAYER_ID.mlp.up_gate_proj.weight, fused_ffn

This module understands the subset a single-device dense decoder uses (rename, ``^T``,
``fused_qkv``, ``fused_ffn``, ``fused_qkv_old``, ``-> _``), so the fallback follows each
architecture's own declaration instead of a table of ours. Fusions are computed in the
checkpoint's ``[out, in]`` orientation (rows), because the core ``Linear`` weight loaders take
that orientation and transpose (or quantize) themselves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from fastdeploy_core.errors import ModelLoadError

#: statement tags this interpreter implements
KNOWN_TAGS = ("fused_qkv", "fused_ffn", "fused_qkv_old")


class UnsupportedMappingError(ValueError):
    """A statement uses a form of the AOA language this interpreter does not implement."""


@dataclass
class Rule:
    """One expanded statement: ``sources`` (checkpoint names) -> ``dest`` (parameter name).

    ``transposed[i]`` records the ``^T`` of source ``i``: the checkpoint holds ``[out, in]``
    and PaddleFormers wants ``[in, out]``. ``dest`` is ``None`` for ``-> _`` (ignored tensors).
    """

    sources: list[str]
    dest: str | None
    kind: str = "copy"  # copy | fused_qkv | fused_ffn | fused_qkv_old
    transposed: list[bool] = field(default_factory=list)
    num_heads: int = 0
    num_kv_heads: int = 0
    #: when ``dest`` is one shard of a merged parameter (set by the model, not by statements)
    shard: str | None = None


def _split_top(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_statement(statement: str) -> Rule:
    """One AOA statement (with ``$LAYER_ID`` still in it) -> :class:`Rule`."""
    if "->" not in statement:
        raise UnsupportedMappingError(f"no '->' in mapping statement {statement!r}")
    left, right = statement.split("->", 1)
    sources = _split_top(left)
    parts = _split_top(right)
    dests, options, kind = [], {}, "copy"
    for part in parts:
        if "=" in part:
            key, value = (s.strip() for s in part.split("=", 1))
            options[key] = value
        elif part in KNOWN_TAGS:
            kind = part
        elif re.fullmatch(r"[A-Za-z_][\w.$]*", part):
            dests.append(part)
        else:
            raise UnsupportedMappingError(f"unknown token {part!r} in mapping statement {statement!r}")
    unknown = set(options) - {"num_heads", "num_key_value_groups", "axis"}
    if unknown:
        raise UnsupportedMappingError(f"unsupported options {sorted(unknown)} in {statement!r}")
    transposed = [s.endswith("^T") for s in sources]
    sources = [s.removesuffix("^T") for s in sources]
    if any(not re.fullmatch(r"[A-Za-z_][\w.$]*", s) for s in sources):
        raise UnsupportedMappingError(f"unsupported source expression in {statement!r}")
    if len(dests) != 1:
        raise UnsupportedMappingError(f"expected one destination in {statement!r} (splits are not supported)")
    # one source for fused_ffn / fused_qkv_old: the checkpoint already holds the fused tensor
    expected_sources = {"copy": (1,), "fused_qkv": (3,), "fused_ffn": (1, 2), "fused_qkv_old": (1,)}[kind]
    if len(sources) not in expected_sources:
        raise UnsupportedMappingError(f"{kind} with {len(sources)} sources in {statement!r}")
    dest = None if dests[0] == "_" else dests[0]
    rule = Rule(sources, dest, kind, transposed)
    if kind in ("fused_qkv", "fused_qkv_old"):
        try:
            rule.num_heads = int(options["num_heads"])
            # PaddleFormers passes the number of KV heads under the name num_key_value_groups
            rule.num_kv_heads = int(options["num_key_value_groups"])
        except (KeyError, ValueError):
            raise UnsupportedMappingError(
                f"{kind} without integer num_heads/num_key_value_groups in {statement!r}"
            ) from None
        if rule.num_heads % rule.num_kv_heads:
            raise UnsupportedMappingError(f"num_heads not a multiple of the KV heads in {statement!r}")
    return rule


def expand_layers(rule: Rule, num_layers: int) -> list[Rule]:
    """Instantiate ``$LAYER_ID`` for every decoder layer (rules without it are returned as is)."""
    text = " ".join(rule.sources + [rule.dest or ""])
    if "$LAYER_ID" not in text:
        return [rule]
    out = []
    for i in range(num_layers):
        sub = str(i)
        out.append(
            Rule(
                [s.replace("$LAYER_ID", sub) for s in rule.sources],
                rule.dest.replace("$LAYER_ID", sub) if rule.dest else None,
                rule.kind,
                list(rule.transposed),
                rule.num_heads,
                rule.num_kv_heads,
            )
        )
    return out


def build_rules(statements: list[str], num_layers: int) -> list[Rule]:
    """Parse and expand every statement; raises :class:`UnsupportedMappingError` on the first unknown form."""
    rules: list[Rule] = []
    for statement in statements:
        rules.extend(expand_layers(parse_statement(statement), num_layers))
    return rules


def fuse(rule: Rule, arrays: list[np.ndarray]) -> np.ndarray:
    """The fused tensor of ``rule`` in the checkpoint's ``[out, in]`` (or ``[out]``) orientation.

    ``fused_qkv`` groups rows per KV head: the query heads that read KV head ``g``, then the
    key head ``g``, then the value head ``g`` — the layout PaddleFormers' attention reshapes
    to ``[..., kv_heads, (group + 2) * head_dim]`` and splits. ``fused_ffn`` stacks gate over
    up (PaddleFormers' MLP chunks the output in that order). A single already-fused source
    (``fused_ffn`` from one tensor, ``fused_qkv_old``) holds ``[gate; up]`` / ``[q; k; v]``,
    which on one device is already the layout PaddleFormers wants.
    """
    if len(arrays) == 1 and rule.kind in ("fused_ffn", "fused_qkv_old"):
        return arrays[0]
    if rule.kind == "fused_ffn":
        return np.concatenate(arrays, axis=0)
    q, k, v = arrays
    head_dim = q.shape[0] // rule.num_heads
    if q.shape[0] != rule.num_heads * head_dim or k.shape[0] != rule.num_kv_heads * head_dim or k.shape != v.shape:
        raise ModelLoadError(
            f"{rule.dest}: q/k/v tensors of shapes {q.shape}, {k.shape}, {v.shape} do not fit "
            f"{rule.num_heads} query and {rule.num_kv_heads} KV heads"
        )
    group = rule.num_heads // rule.num_kv_heads
    pieces = []
    for g in range(rule.num_kv_heads):
        pieces.append(q[g * group * head_dim : (g + 1) * group * head_dim])
        pieces.append(k[g * head_dim : (g + 1) * head_dim])
        pieces.append(v[g * head_dim : (g + 1) * head_dim])
    return np.concatenate(pieces, axis=0)
