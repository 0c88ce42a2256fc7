"""The quantizer contract: what a quantization method registered through ``register_quantizers`` provides.

A quantizer is two things at once:

* the ``quant_config`` object a model passes to its layers: ``get_quant_method(layer, prefix)``
  returns the method for a linear layer it :meth:`~QuantizerBase.applies_to`, else ``None``
  (the layer stays float32);
* the linear method itself (:class:`~fastdeploy_core.layers.linear.LinearMethodBase`), which
  keeps its per-layer state on the layer:

  - :meth:`~QuantizerBase.create_weights` registers the compact storage on the layer
    (``layer.weight`` and e.g. ``weight_scale``); ``layer.weight`` carries the
    ``weight_loader`` the model's ``load_weights`` calls;
  - the loader converts float checkpoint tensors online (:meth:`~QuantizerBase.quantize`,
    column range by column range, so merged Q/K/V and gate/up shards load independently),
    copies pre-quantized tensors (``is_quantized`` checkpoints: the scales are parameters the
    checkpoint fills too), or unpacks GGUF blocks without a float round trip when the method
    accepts that block type (:meth:`~QuantizerBase.load_gguf`);
  - :meth:`~QuantizerBase.apply` runs the layer through the device's op ``ops.<device_op>``
    when the device's ops table has it, else through :meth:`~QuantizerBase.reference_op`,
    the plain-Paddle formula every device op must match.

Each method declares its settings as a pydantic model (:attr:`QuantizerBase.config_class`);
``--quantization '{"quantization": "wint4", "group_size": 64}'`` fills it, and a bad field is a
:class:`~fastdeploy_core.errors.QuantizationError` naming the field.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import numpy as np
import paddle
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fastdeploy_core.devices.current import current_ops
from fastdeploy_core.errors import ModelLoadError, QuantizationError
from fastdeploy_core.layers.linear import LinearMethodBase
from fastdeploy_core.layers.weights import new_parameter, replace_parameter


class QuantizerConfig(BaseModel):
    """Settings every quantizer accepts; methods subclass this and add their own."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    is_quantized: bool = Field(False, description="the checkpoint already holds quantized tensors and scales")
    modules_to_not_convert: list[str] = Field(
        default_factory=list, description="layer-name patterns (fnmatch, or a plain substring) kept in float32"
    )
    kv_cache_quant_type: Literal["int8"] | None = Field(None, description="quantize the KV cache too")
    lm_head_quant_type: Literal["wint8"] | None = Field(
        None, description="store the LM head (a tied head included) as per-channel int8; None keeps it float32"
    )
    embedding_quant_type: Literal["wint8"] | None = Field(
        None, description="store the token embedding as int8 rows (groups of 32); None keeps it float32"
    )


class QuantizerBase(LinearMethodBase):
    """Base of every quantization method. Subclasses set the class attributes and the hooks."""

    #: The registry name (``--quantization NAME``).
    name: ClassVar[str] = ""
    #: The pydantic settings model.
    config_class: ClassVar[type[QuantizerConfig]] = QuantizerConfig
    #: Name of the device op that runs this method (``ops.<device_op>(x, *op_args, bias)``).
    device_op: ClassVar[str | None] = None
    #: Whether :meth:`apply` takes ``x`` as bfloat16 rows too (the same result as the float32
    #: values they hold): a norm before the layer may then write bfloat16.
    takes_bf16_rows = False
    #: Name of a device op computing ``silu_and_mul`` of :attr:`device_op`'s output in one call
    #: (``ops.<fused_silu_op>(x, *op_args, bias)``), which a merged gate/up projection uses when
    #: the ops table has it (:meth:`apply_silu_and_mul`).
    fused_silu_op: ClassVar[str | None] = None
    #: Name of a device op giving each row's argmax of :attr:`device_op`'s output (an LM head's
    #: greedy tokens) without the logits (``ops.<fused_argmax_op>(x, *op_args, bias)``).
    fused_argmax_op: ClassVar[str | None] = None
    #: GGUF tensor types (``"Q8_0"``, ``"Q4_1"``...) :meth:`load_gguf` takes without dequantizing.
    gguf_types: ClassVar[tuple[str, ...]] = ()
    #: Whether the device must declare this method in ``Device.quantization_methods``. A
    #: third-party method whose ``apply`` is plain Paddle ops every device runs may say False.
    requires_device_support: ClassVar[bool] = True
    #: Whether MoE experts can be stored by this method (:meth:`get_moe_method`); such a method
    #: also implements :meth:`weight_from_storage`.
    quantizes_experts: ClassVar[bool] = False
    #: Largest ``max|y - y_float| / max|y_float|`` expected of a layer with Gaussian weights and
    #: inputs (the conformance check and the tests hold each method to it).
    expected_error: ClassVar[float] = 0.25

    def __init__(self, config: QuantizerConfig | dict | None = None):
        if isinstance(config, QuantizerConfig):
            self.config = config
        else:
            self.config = self.validate_config(config or {})

    # ---- configuration --------------------------------------------------------------------
    @classmethod
    def validate_config(cls, data: dict) -> QuantizerConfig:
        """``data`` as this method's settings; QuantizationError names each bad field."""
        try:
            return cls.config_class.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '(config)'}: {err['msg']} (given {err.get('input')!r})"
                for err in exc.errors()
            )
            allowed = ", ".join(sorted(cls.config_class.model_fields))
            raise QuantizationError(
                f"quantization {cls.name!r}: {problems}; its settings are: {allowed}", param="quantization"
            ) from None

    @classmethod
    def from_config(cls, data: dict, resolver: Callable[[str], QuantizerBase] | None = None) -> QuantizerBase:
        """Build from a config dict (without the ``quantization`` key).

        ``resolver(name)`` builds another registered method by name, for composite methods
        such as ``mix_quant``; simple methods ignore it.
        """
        return cls(cls.validate_config(data))

    def describe(self) -> dict:
        """Name and settings, for logs and ``fastdeploy env``."""
        return {"quantization": self.name, **self.config.model_dump()}

    def required_methods(self) -> list[str]:
        """Every registered method a device must run for this one to work (itself by default)."""
        return [self.name]

    @property
    def kv_cache_method(self):
        """The KV cache quantizer (``kv_cache_quant_type``) or ``None`` for a float cache."""
        if self.config.kv_cache_quant_type == "int8":
            from fastdeploy_core.quantization.kv_cache import Int8KVCacheQuantizer

            return Int8KVCacheQuantizer()
        return None

    # ---- which layers -----------------------------------------------------------------------
    def applies_to(self, layer_name: str) -> bool:
        """Whether the linear layer ``layer_name`` (its checkpoint prefix) is quantized."""
        for pattern in self.config.modules_to_not_convert:
            if fnmatch.fnmatchcase(layer_name, pattern) or pattern in layer_name:
                return False
        return True

    def get_quant_method(self, layer, prefix: str) -> LinearMethodBase | None:
        """The ``quant_config`` contract of :class:`~fastdeploy_core.layers.linear.Linear`.

        The LM head (prefix ``lm_head``) gets :meth:`lm_head_method`, every other layer this
        method :meth:`applies_to` gets the method itself.
        """
        if not self.applies_to(prefix):
            return None
        if is_lm_head(prefix):
            return self.lm_head_method()
        return self

    def get_moe_method(self, layer, prefix: str):
        """The experts' method of a :class:`~fastdeploy_core.layers.moe.FusedMoE` (the router is never
        quantized): :class:`~fastdeploy_core.quantization.experts.QuantizedExperts` over this method,
        ``None`` for float experts (``modules_to_not_convert``). A method that cannot store experts
        refuses the model rather than leave its largest weights silently float32."""
        if not self.applies_to(prefix):
            return None
        if not self.quantizes_experts:
            raise QuantizationError(
                f"quantization {self.name!r} cannot store mixture-of-experts weights ({prefix}); use wint8 or "
                f"wint4, or mix_quant with moe_quant_type wint8/wint4, or keep the experts float32 with "
                f'modules_to_not_convert ["*.experts"]',
                param="quantization",
            )
        from fastdeploy_core.quantization.experts import QuantizedExperts

        return QuantizedExperts(self)

    def weight_from_storage(self, tensors: dict[str, paddle.Tensor], rows: int) -> paddle.Tensor:
        """Float32 ``[rows, out]`` weight from this method's storage tensors of one linear (no
        device layout), the formula of its linear op; methods with :attr:`quantizes_experts`."""
        raise NotImplementedError

    def get_embedding_method(self, layer, prefix: str):
        """The token embedding's method (:class:`~fastdeploy_core.quantization.embedding.Int8EmbeddingMethod`) or ``None``."""
        if self.config.embedding_quant_type != "wint8" or not self.applies_to(prefix):
            return None
        from fastdeploy_core.quantization.embedding import Int8EmbeddingMethod

        hidden = int(getattr(layer, "hidden_size", 0) or 0)
        return Int8EmbeddingMethod(32 if hidden and hidden % 32 == 0 else None)

    def lm_head_method(self) -> LinearMethodBase | None:
        """The LM head's method: per-channel int8 with ``lm_head_quant_type: wint8``, else float32.

        On a bandwidth-bound cpu decode the head is a fifth of the weights read per token
        (llama.cpp keeps it Q8_0 in its Q4 files for the same reason); int8 per channel costs
        it almost no accuracy, 4 bits would.
        """
        if self.config.lm_head_quant_type is None:
            return None
        # Built by name through the registry: the base never imports the methods derived from it.
        from fastdeploy_core.quantization.factory import build_quantizer

        return build_quantizer(
            self.config.lm_head_quant_type, {"modules_to_not_convert": self.config.modules_to_not_convert}, None
        )

    # ---- storage ------------------------------------------------------------------------------
    def storage_shapes(self, input_size: int, output_size: int) -> dict[str, tuple[list[int], str]]:
        """Tensor name -> (shape, dtype) of the compact storage of one layer; ``weight`` first."""
        raise NotImplementedError

    def create_weights(self, layer) -> None:
        """Register the compact storage on ``layer`` (and a float32 bias if it has one)."""
        shapes = self.storage_shapes(layer.input_size, layer.output_size)
        current_ops().prepare_quantization()  # e.g. the cpu kernels build now, not in the first request
        for tensor_name, (shape, dtype) in shapes.items():
            if tensor_name == "weight" or self.config.is_quantized:
                param = layer.create_parameter(
                    shape, dtype=dtype, default_initializer=paddle.nn.initializer.Constant(0)
                )
                param.stop_gradient = True
                param.weight_loader = self._make_loader(layer, tensor_name)
                setattr(layer, tensor_name, param)
            else:
                # Derived from the weight while it loads: a buffer, so model loaders that
                # expect every parameter in the checkpoint do not wait for it.
                layer.register_buffer(tensor_name, paddle.zeros(shape, dtype=dtype), persistable=True)
        if layer.has_bias:
            layer.bias = new_parameter(layer, [layer.output_size])
            layer.bias.weight_loader = layer.weight_loader
        else:
            layer.bias = None

    def _make_loader(self, layer, tensor_name: str):
        def weight_loader(param, loaded, shard_id=None) -> None:
            self.load_tensor(layer, tensor_name, loaded, shard_id)

        return weight_loader

    @staticmethod
    def column_range(layer, shard_id) -> tuple[int, int]:
        """Output columns ``[start, stop)`` a checkpoint shard fills."""
        if shard_id is None:
            return 0, layer.output_size
        return layer.shard_range(shard_id)

    def load_tensor(self, layer, tensor_name: str, loaded, shard_id=None) -> None:
        """Fill ``tensor_name``'s columns of ``shard_id`` from a checkpoint tensor.

        ``loaded`` is a float array ``[out, in]`` (quantized online), a pre-quantized array in
        checkpoint orientation (``weight [out, in]`` or, packed, ``[out, in / 2]``; scales
        ``[out]`` or ``[out, G]``), or a :class:`~fastdeploy_core.quantization.gguf.GGUFBlocks`.
        """
        from fastdeploy_core.loader.gguf_blocks import GGUFBlocks

        start, stop = self.column_range(layer, shard_id)
        where = f"{layer.prefix or 'linear'}" + (f" shard {shard_id!r}" if shard_id is not None else "")
        if isinstance(loaded, GGUFBlocks):
            if tensor_name != "weight":
                raise ModelLoadError(f"{where}: GGUF blocks can only fill a weight, not {tensor_name}")
            if loaded.shape != (stop - start, layer.input_size):
                raise ModelLoadError(
                    f"{where}: GGUF tensor of shape {loaded.shape}, expected {(stop - start, layer.input_size)}"
                )
            if self.accepts_gguf(loaded.type_name):
                tensors = self.load_gguf(loaded)
            else:
                tensors = self.quantize(loaded.dequantize().T)
            self.write_columns(layer, tensors, start, stop, where)
            return
        array = np.asarray(loaded)
        if tensor_name == "weight" and array.dtype.kind == "f" and not self.config.is_quantized:
            if array.shape != (stop - start, layer.input_size):
                raise ModelLoadError(
                    f"{where}: checkpoint weight of shape {array.shape}, expected {(stop - start, layer.input_size)}"
                )
            self.write_columns(
                layer, self.quantize(np.ascontiguousarray(array.T, dtype=np.float32)), start, stop, where
            )
            return
        # A pre-quantized tensor: checkpoint orientation [out, ...] -> storage [..., out].
        array = array.reshape(array.shape[0], -1).T if array.ndim >= 1 else array
        self.write_columns(layer, {tensor_name: array}, start, stop, where)

    def write_columns(self, layer, tensors: dict[str, np.ndarray], start: int, stop: int, where: str) -> None:
        """Copy storage tensors holding columns ``[start, stop)`` into the layer's storage."""
        for tensor_name, array in tensors.items():
            target = getattr(layer, tensor_name)
            expected = (int(target.shape[0]), stop - start)
            if tuple(array.shape) != expected:
                raise ModelLoadError(
                    f"{where}: {tensor_name} of shape {tuple(array.shape)} does not fit storage {expected} "
                    f"(columns {start}:{stop} of {tuple(target.shape)}); check the quantization settings"
                )
            if start == 0 and stop == int(target.shape[1]):
                target.set_value(self.to_storage_tensor(array, target.dtype))
            elif target.dtype == paddle.float8_e4m3fn:
                # Paddle's CPU build has no slice-assign kernel for float8: update the columns
                # in float32 (exact for e4m3 values) and store the whole tensor again.
                whole = target.astype("float32").numpy()
                whole[:, start:stop] = array
                target.set_value(self.to_storage_tensor(whole, target.dtype))
            else:
                target[:, start:stop] = self.to_storage_tensor(array, target.dtype)

    @staticmethod
    def to_storage_tensor(array: np.ndarray, dtype) -> paddle.Tensor:
        """A numpy array as a Paddle tensor of the storage dtype."""
        if dtype == paddle.float8_e4m3fn:
            return paddle.to_tensor(np.asarray(array, dtype=np.float32)).astype(paddle.float8_e4m3fn)
        return paddle.to_tensor(np.ascontiguousarray(array))

    # ---- conversion ---------------------------------------------------------------------------
    def quantize(self, weight: np.ndarray) -> dict[str, np.ndarray]:
        """Float32 ``weight [in, n]`` -> storage tensors for those ``n`` columns (online conversion)."""
        raise NotImplementedError

    def accepts_gguf(self, type_name: str) -> bool:
        """Whether :meth:`load_gguf` takes GGUF blocks of ``type_name`` as stored (else they are dequantized and requantized)."""
        return type_name in self.gguf_types

    def for_gguf(self, tensor_types: set[str]) -> QuantizerBase:
        """This method adapted to a GGUF checkpoint whose linear weights have ``tensor_types``.

        GGUF blocks are groups of 32 input rows: when every linear weight is of a type this
        method takes and the user set no ``group_size``, the storage uses groups of 32 so the
        blocks load as stored. Otherwise ``self`` (weights are dequantized and requantized).
        """
        fields = type(self.config).model_fields
        if "group_size" not in fields or "group_size" in self.config.model_fields_set:
            return self
        if not tensor_types or not tensor_types <= set(self.gguf_types):
            return self
        return type(self)(self.config.model_copy(update={"group_size": 32}))

    def gguf_block_filter(self, model) -> Callable[[str, str], bool]:
        """``keep(hf_name, type_name)``: whether a GGUF loader should hand this tensor over as blocks.

        True for the weight of a linear layer this method quantizes when it takes that block
        type; the name is mapped through the model's ``packed_modules_mapping`` (q_proj ->
        qkv_proj ...) to find the layer.
        """
        from fastdeploy_core.quantization.embedding import Int8EmbeddingMethod

        takes: dict[str, Any] = {}
        heads_take_blocks = True
        for name, layer in model.named_sublayers():
            method = getattr(layer, "quant_method", None)
            if isinstance(method, (QuantizerBase, Int8EmbeddingMethod)):
                takes[name] = method
            if is_lm_head(name) and not isinstance(method, QuantizerBase):
                heads_take_blocks = (
                    False  # a float head cannot take blocks, and a tied head shares the embedding's tensor
                )
        for name in [n for n, m in takes.items() if isinstance(m, Int8EmbeddingMethod)]:
            if not heads_take_blocks:
                del takes[name]
        mapping = getattr(model, "packed_modules_mapping", {}) or {}

        def keep(hf_name: str, type_name: str) -> bool:
            if not hf_name.endswith(".weight"):
                return False
            prefix = hf_name[: -len(".weight")]
            for part, (fused, _) in mapping.items():
                if prefix == part or prefix.endswith(f".{part}"):
                    prefix = prefix[: -len(part)] + fused
                    break
            method = takes.get(prefix)
            return method is not None and method.accepts_gguf(type_name)

        return keep

    def load_gguf(self, blocks) -> dict[str, np.ndarray]:
        """GGUF blocks of one tensor -> storage tensors, without dequantizing to float."""
        raise QuantizationError(f"{self.name} does not take GGUF {blocks.type_name} blocks directly")

    def dequantize(self, layer) -> paddle.Tensor:
        """The float32 ``[in, out]`` weight the storage represents (tests, accuracy checks)."""
        raise NotImplementedError

    # ---- compute --------------------------------------------------------------------------------
    def op_args(self, layer) -> tuple:
        """The storage arguments of :attr:`device_op` and :meth:`reference_op`, after ``x``."""
        raise NotImplementedError

    def reference_args(self, layer) -> tuple:
        """:meth:`op_args` in the plain layout :meth:`reference_op` reads: each tensor the device
        laid out for its op (``prepare_linear_weight`` / ``prepare_int4_weights``) is handed back
        through the current ops table's ``unprepare_linear_weight``."""
        plain = current_ops().unprepare_linear_weight
        return tuple(plain(a) if isinstance(a, paddle.Tensor) else a for a in self.op_args(layer))

    @staticmethod
    def reference_op(x: paddle.Tensor, *args: Any) -> paddle.Tensor:
        """The plain-Paddle formula of :attr:`device_op`: ``(x, *op_args, bias) -> y``."""
        raise NotImplementedError

    def _layer_args(self, layer) -> tuple:
        """:meth:`op_args` and the bias, collected once per layer (a decode step applies ~120
        layers, and Paddle's layer attribute lookup is slow)."""
        args = layer.__dict__.get("_quant_op_args")
        if args is None:
            args = layer.__dict__["_quant_op_args"] = (*self.op_args(layer), layer.bias)
        return args

    def _device_ops(self) -> tuple:
        """``(ops, op, fused_silu, fused_argmax)`` of the current ops table, looked up once per
        table: :attr:`device_op` (else :meth:`reference_op`) and the fused ops it has (else None)."""
        ops = current_ops()
        found = self.__dict__.get("_found_ops")
        if found is None or found[0] is not ops:
            def named(name):
                return getattr(ops, name, None) if name else None

            found = self.__dict__["_found_ops"] = (
                ops, named(self.device_op) or self.reference_op, named(self.fused_silu_op), named(self.fused_argmax_op))
        return found

    def apply(self, layer, x: paddle.Tensor) -> paddle.Tensor:
        """``y = x @ W (+ b)`` through the device op when the ops table has it, else the reference."""
        return self._device_ops()[1](x, *self._layer_args(layer))

    def apply_silu_and_mul(self, layer, x: paddle.Tensor) -> paddle.Tensor:
        """``silu_and_mul(apply(layer, x))`` for a merged gate/up projection: the device op
        :attr:`fused_silu_op` when this method names one and the ops table has it, else the two."""
        ops, op, fused, _ = self._device_ops()
        args = self._layer_args(layer)
        return fused(x, *args) if fused is not None else ops.silu_and_mul(op(x, *args))

    def apply_argmax(self, layer, x: paddle.Tensor) -> np.ndarray:
        """Each row's argmax of ``apply(layer, x)`` (a head's greedy tokens): the device op
        :attr:`fused_argmax_op` when this method names one and the ops table has it, else
        ``ops.argmax_rows`` of the logits."""
        ops, op, _, fused = self._device_ops()
        args = self._layer_args(layer)
        return fused(x, *args) if fused is not None else ops.argmax_rows(op(x, *args))

    def adopt_device_layout(self, layer, prepare: str, names: tuple[str, ...]) -> bool:
        """Whether the ops table's ``prepare`` method laid the storage tensors ``names`` out for
        this method's op (then they replace the layer's), e.g. the cpu ops' int4 VNNI or int8
        quad layouts; ``False`` when the table has no such method or it declined (``None``)."""
        ops = current_ops()
        if not hasattr(ops, prepare):
            return False
        prepared = getattr(ops, prepare)(*(getattr(layer, name) for name in names))
        if prepared is None:
            return False
        self.replace_storage(layer, names, prepared)
        return True

    @staticmethod
    def replace_storage(layer, names: tuple[str, ...], values) -> None:
        """Put a device's laid-out storage tensors in place of the layer's (buffers stay buffers,
        parameters parameters) and forget cached op arguments."""
        for name, value in zip(names, values):
            if name in layer._buffers:
                layer.register_buffer(name, value, persistable=True)
            else:
                replace_parameter(layer, name, value)
        layer.__dict__.pop("_quant_op_args", None)

    def process_weights_after_loading(self, layer) -> None:
        """Let the device lay the weight storage out as its op reads it fastest; forget cached
        op arguments (storage may have been replaced while loading)."""
        if self.device_op and hasattr(current_ops(), self.device_op):
            prepared = current_ops().prepare_linear_weight(layer.weight)
            if prepared is not None:
                replace_parameter(layer, "weight", prepared)
        layer.__dict__.pop("_quant_op_args", None)

    def storage_bytes(self, layer) -> int:
        """Bytes of the layer's weight storage (parameters and buffers)."""
        total = 0
        for tensor in list(layer.parameters(include_sublayers=False)) + list(layer.buffers(include_sublayers=False)):
            total += int(np.prod(tensor.shape)) * tensor.element_size()
        return total


def is_lm_head(prefix: str) -> bool:
    return prefix == "lm_head" or prefix.endswith(".lm_head")


def add_bias(y: paddle.Tensor, bias: paddle.Tensor | None) -> paddle.Tensor:
    return y if bias is None else y + bias


def expand_groups(scale: paddle.Tensor, group_size: int, rows: int) -> paddle.Tensor:
    """Per-group rows ``[G, N]`` -> per-row ``[rows, N]`` (the last group may be short)."""
    if int(scale.shape[0]) == 1:
        return scale
    return paddle.repeat_interleave(scale, group_size, axis=0)[:rows]
