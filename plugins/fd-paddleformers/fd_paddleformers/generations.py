"""What differs between the two PaddleFormers generations the fallback runs on, in one place.

PaddleFormers 0.4 (on PyPI, builds Qwen2/Qwen3/Qwen3-MoE/DeepSeek-V3/ERNIE-4.5 without
``paddlefleet``) and PaddleFormers 1.x (builds Llama, Phi3 and ERNIE-4.5; its Qwen and DeepSeek
modules import ``paddlefleet``, which is not on PyPI) share the model-building pieces the
fallback drives (the attention-function table, ``nn.norm.RMSNorm``, ``nn.mlp.MLP``,
``CONFIG_MAPPING``, ``MAPPING_NAMES``) and differ in four things, each a method here:

* the tensor layout their attention modules hand the attention function
  (0.4: ``[batch, T, heads, dim]``; 1.x: ``[batch, heads, T, dim]``);
* how checkpoint names become parameters (0.4: HF's names under the base-model prefix, with
  linears transposed; 1.x: the ``_gen_aoa_config`` declaration, see :mod:`weight_mapping`);
* config keys (0.4: ``tensor_parallel_degree``/``fuse_rope`` and ``rope_theta``/``num_experts``
  read only at the top level; 1.x: ``tensor_model_parallel_size``/``apply_rope_fusion``);
* which class is a family's base model (1.x renames some through ``MAPPING_SPACIAL_KEY``).

:func:`installed_generation` picks the adapter from ``paddleformers.__version__``.
"""

from __future__ import annotations

from typing import ClassVar

import paddle

from fd_paddleformers.weight_mapping import Rule, UnsupportedMappingError, build_rules

#: config switches both generations understand: one device, no training features, no fused
#: kernels a device may lack (each is a no-op for families that do not read it)
COMMON_OVERRIDES = {
    "dtype": "float32",
    "sequence_parallel": False,
    "use_cache": False,
    "fuse_rms_norm": False,
    "use_fused_rms_norm": False,
    "use_fused_rope": False,
    "recompute": False,
    "recompute_granularity": None,
    # multi-token-prediction heads (ERNIE-4.5-MoE, DeepSeek-V3) serve speculative decoding only
    "num_nextn_predict_layers": 0,
}


class MappingNotDeclared(ValueError):
    """The generation's checkpoint mapping cannot be read for this class."""


class Generation:
    """One PaddleFormers generation's adapter; subclasses fill the differences."""

    #: human name, printed in ``supports()`` reasons and errors
    name = ""
    #: version prefixes this adapter was checked on
    versions: tuple[str, ...] = ()
    #: generation-specific config switches, on top of :data:`COMMON_OVERRIDES`
    overrides: ClassVar[dict] = {}

    def config_overrides(self) -> dict:
        return {**COMMON_OVERRIDES, **self.overrides}

    def prepare_config(self, hf_config: dict) -> dict:
        """The checkpoint's config values as this generation's config class reads them."""
        return dict(hf_config)

    def base_model_name(self, auto_modeling, family: str) -> str:
        return family + "Model"

    def mapping_rules(self, base_model_cls: type, config) -> list[Rule]:
        """Declared checkpoint -> parameter rules; parameters they leave out load by equal name."""
        raise NotImplementedError

    def attention_tokens(self, query: paddle.Tensor, key: paddle.Tensor, value: paddle.Tensor):
        """The attention function's q/k/v as ``[T, heads, dim]`` tensors (batch is 1)."""
        raise NotImplementedError

    def prepare_modules(self) -> None:
        """Adjust PaddleFormers' modules once before a model is built (idempotent)."""


def _tokens_from_bthd(x: paddle.Tensor) -> paddle.Tensor:
    _, num_tokens, heads, dim = x.shape
    return x.reshape([num_tokens, heads, dim])


def _tokens_from_bhtd(x: paddle.Tensor) -> paddle.Tensor:
    _, heads, num_tokens, dim = x.shape
    if num_tokens == 1:  # one decode token: [1, h, 1, d] already has the memory order of [1, h, d]
        return x.reshape([1, heads, dim])
    return x.transpose([0, 2, 1, 3]).reshape([num_tokens, heads, dim])


class PaddleFormers04(Generation):
    """PaddleFormers 0.4: HF names, ``[b, T, h, d]`` attention, top-level-only config keys."""

    name = "PaddleFormers 0.4"
    versions = ("0.4.",)
    overrides: ClassVar[dict] = {
        "tensor_parallel_degree": 1,
        "fuse_rope": False,
        "fuse_linear": False,
        "fuse_attention_qkv": False,
    }

    def prepare_config(self, hf_config: dict) -> dict:
        values = dict(hf_config)
        # transformers 5 writes rope_theta only inside rope_parameters; 0.4 reads it only at the
        # top level and otherwise silently uses its own default (10000)
        rope = values.get("rope_parameters") or values.get("rope_scaling") or {}
        if "rope_theta" not in values and isinstance(rope, dict) and "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; 0.4 reads num_experts
        # (its default, 60, would build the wrong number of experts)
        if "num_local_experts" in values and "num_experts" not in values:
            values["num_experts"] = values["num_local_experts"]
        # transformers 5 writes a scaled rope (DeepSeek-V3's YaRN) as rope_parameters with
        # "rope_type"; 0.4 reads it only as rope_scaling with "type"
        if isinstance(rope, dict) and rope.get("rope_type", "default") != "default" and not values.get("rope_scaling"):
            values["rope_scaling"] = {**rope, "type": rope["rope_type"]}
        return values

    def mapping_rules(self, base_model_cls: type, config) -> list[Rule]:
        # 0.4's parameters carry HF's names (under base_model_prefix); its linears are [in, out]
        # (transpose_weight_keys): the model's equal-name rules cover everything.
        return []

    def attention_tokens(self, query, key, value):
        return _tokens_from_bthd(query), _tokens_from_bthd(key), _tokens_from_bthd(value)

    def prepare_modules(self) -> None:
        # 0.4's MLP calls paddle.incubate's swiglu, which since Paddle 3.3 emits a deprecation
        # warning on every call (one per decode step in the server's log); paddle.nn.functional's
        # is the same kernel (bitwise equal outputs)
        import paddle.nn.functional as F
        from paddleformers.nn import mlp

        if hasattr(F, "swiglu"):
            mlp.fused_swiglu = F.swiglu


class PaddleFormers1(Generation):
    """PaddleFormers 1.x: ``_gen_aoa_config`` mappings, ``[b, h, T, d]`` attention."""

    name = "PaddleFormers 1.x"
    versions = ("1.",)
    overrides: ClassVar[dict] = {"tensor_model_parallel_size": 1, "apply_rope_fusion": False}

    def base_model_name(self, auto_modeling, family: str) -> str:
        return auto_modeling.MAPPING_SPACIAL_KEY.get(family, family) + "Model"

    def mapping_rules(self, base_model_cls: type, config) -> list[Rule]:
        generate = getattr(base_model_cls, "_gen_aoa_config", None)
        if generate is None:
            raise MappingNotDeclared(f"{base_model_cls.__name__} declares no checkpoint mapping (_gen_aoa_config)")
        statements = generate(config)["aoa_statements"]
        try:
            return build_rules(statements, int(config.num_hidden_layers))
        except UnsupportedMappingError as exc:
            raise MappingNotDeclared(f"its checkpoint mapping uses a form the fallback does not load: {exc}") from None

    def attention_tokens(self, query, key, value):
        return _tokens_from_bhtd(query), _tokens_from_bhtd(key), _tokens_from_bhtd(value)


GENERATIONS = (PaddleFormers04(), PaddleFormers1())


def generation_for(version: str) -> Generation | None:
    """The adapter for PaddleFormers ``version`` (``"0.4.0"``, ``"1.2.0"``), or ``None``."""
    for generation in GENERATIONS:
        if version.startswith(generation.versions):
            return generation
    return None
