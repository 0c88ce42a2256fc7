"""``mix_quant``: one method for dense linears, another for MoE experts, optionally an int8 KV cache.

``{"quantization": "mix_quant", "dense_quant_type": "wint8", "moe_quant_type": "wint4",
"kv_cache_quant_type": "int8"}`` as FastDeploy takes it. Each part is a registered method,
built through the same registry (so a third-party method works as a part too); a layer is an
MoE expert layer when it says so (``layer.is_moe_expert``) or its name holds ``.experts.``.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import Field

from fastdeploy_core.errors import QuantizationError
from fastdeploy_core.quantization.base import QuantizerBase, QuantizerConfig, is_lm_head


class MixQuantConfig(QuantizerConfig):
    dense_quant_type: str | None = Field(None, description="method for dense linear layers; None keeps them float32")
    moe_quant_type: str | None = Field(None, description="method for MoE expert layers; default: dense_quant_type")
    image_moe_quant_type: str | None = Field(
        None, description="FastDeploy's method for a vision tower's experts; refused: no multimodal model runs here"
    )


class MixQuant(QuantizerBase):
    """Routes each linear layer to the dense or the MoE method."""

    name = "mix_quant"
    config_class = MixQuantConfig

    def __init__(self, config=None, dense: QuantizerBase | None = None, moe: QuantizerBase | None = None):
        super().__init__(config)
        self.dense = dense
        self.moe = moe

    @classmethod
    def from_config(cls, data: dict, resolver: Callable[[str], QuantizerBase] | None = None) -> MixQuant:
        config = cls.validate_config(data)
        if config.dense_quant_type is None and config.moe_quant_type is None and config.kv_cache_quant_type is None:
            raise QuantizationError(
                "mix_quant needs at least one of dense_quant_type, moe_quant_type, kv_cache_quant_type",
                param="quantization",
            )
        if config.image_moe_quant_type is not None:
            # Nothing would apply it: no model served here has image experts.
            raise QuantizationError(
                f"mix_quant: image_moe_quant_type ({config.image_moe_quant_type!r}) is not supported: no model "
                "served here has image MoE experts, so it would never be applied; drop it (moe_quant_type "
                "quantizes the MoE experts)",
                param="quantization",
            )
        if resolver is None:
            raise QuantizationError("mix_quant must be built through the quantization registry", param="quantization")
        for part in (config.dense_quant_type, config.moe_quant_type):
            if part == cls.name:
                raise QuantizationError("mix_quant cannot contain mix_quant", param="quantization")
        shared = {"is_quantized": config.is_quantized, "modules_to_not_convert": config.modules_to_not_convert}
        dense = resolver(config.dense_quant_type, shared) if config.dense_quant_type else None
        moe_type = config.moe_quant_type or config.dense_quant_type
        moe = resolver(moe_type, shared) if moe_type else None
        return cls(config, dense=dense, moe=moe)

    def for_gguf(self, tensor_types: set[str]) -> MixQuant:
        return MixQuant(
            self.config,
            dense=self.dense.for_gguf(tensor_types) if self.dense else None,
            moe=self.moe.for_gguf(tensor_types) if self.moe else None,
        )

    def gguf_block_filter(self, model):
        # The layers' own methods (the parts) decide; the base walks them.
        return QuantizerBase.gguf_block_filter(self, model)

    def get_embedding_method(self, layer, prefix: str):
        return QuantizerBase.get_embedding_method(self, layer, prefix)

    def required_methods(self) -> list[str]:
        names: list[str] = []
        for part in (self.dense, self.moe):
            if part is not None:
                names += [n for n in part.required_methods() if n not in names]
        return names

    def describe(self) -> dict:
        out = super().describe()
        out["dense"] = self.dense.describe() if self.dense else None
        out["moe"] = self.moe.describe() if self.moe else None
        return out

    def get_quant_method(self, layer, prefix: str):
        if is_lm_head(prefix):
            return self.lm_head_method() if self.applies_to(prefix) else None
        is_moe = bool(getattr(layer, "is_moe_expert", False)) or ".experts." in prefix
        part = self.moe if is_moe else self.dense
        if part is None or not self.applies_to(prefix):
            return None
        return part.get_quant_method(layer, prefix)

    def get_moe_method(self, layer, prefix: str):
        if self.moe is None or not self.applies_to(prefix):
            return None
        return self.moe.get_moe_method(layer, prefix)
