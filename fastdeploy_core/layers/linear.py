"""Linear layers whose computation goes through a quantization method.

Weights are stored in Paddle's ``[in, out]`` layout; checkpoint (HF) weights arrive as
``[out, in]`` and are transposed by the weight loader. A quantization method
(``quant_method``) owns how weights are created, loaded and applied; the default
:class:`UnquantizedLinearMethod` keeps float32 weights and calls ``current_ops().linear``.

:class:`MergedColumnLinear` concatenates several projections of the same input along the
output axis (Q/K/V, gate/up) so each is ONE matmul; each checkpoint shard is loaded into its
column range by ``shard_id``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import paddle
from paddle import nn

from fastdeploy_core.devices.current import current_ops
from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.layers.parallel import (
    HeadShare,
    head_share,
    partition,
    split_unit,
    take_columns,
    take_rows,
    tp_group,
)
from fastdeploy_core.layers.weights import as_float32, new_parameter, replace_parameter


class LinearMethodBase:
    """How a linear layer stores and applies its weights (the quantization plug point).

    ``create_weights(layer)`` registers parameters on the layer (each with a
    ``weight_loader``); ``process_weights_after_loading(layer)`` may repack them once all
    shards are in; ``apply(layer, x)`` computes ``x @ W (+ b)``.
    """

    def create_weights(self, layer: Linear) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Hook after loading; nothing to do for plain float32 weights."""

    def apply(self, layer: Linear, x: paddle.Tensor) -> paddle.Tensor:
        raise NotImplementedError

    def apply_silu_and_mul(self, layer: Linear, x: paddle.Tensor) -> paddle.Tensor:
        """``silu_and_mul(apply(layer, x))`` for a merged gate/up projection; a method whose
        device has one op for both (its product then never goes through memory) overrides it."""
        return current_ops().silu_and_mul(self.apply(layer, x))

    def apply_argmax(self, layer: Linear, x: paddle.Tensor) -> np.ndarray:
        """Each row's argmax of ``apply(layer, x)`` (an LM head's greedy tokens; first index on
        ties, as ``ops.argmax_rows``); a method whose device has one op for both overrides it."""
        return current_ops().argmax_rows(self.apply(layer, x))


class UnquantizedLinearMethod(LinearMethodBase):
    """Float32 weight ``[in, out]`` (+ optional bias ``[out]``), applied by ``ops.linear``."""

    def create_weights(self, layer: Linear) -> None:
        layer.weight = new_parameter(layer, [layer.input_size, layer.output_size])
        layer.weight.weight_loader = layer.weight_loader
        if layer.has_bias:
            layer.bias = new_parameter(layer, [layer.output_size])
            layer.bias.weight_loader = layer.weight_loader
        else:
            layer.bias = None

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Let the device store the weight in the layout its ``linear`` reads fastest."""
        prepared = current_ops().prepare_linear_weight(layer.weight)
        if prepared is not None:
            replace_parameter(layer, "weight", prepared)

    def apply_silu_and_mul(self, layer: Linear, x: paddle.Tensor) -> paddle.Tensor:
        """``ops.linear_silu_and_mul``: one kernel where the table has one (the product never
        goes through memory), else the table composes ``linear`` and ``silu_and_mul``."""
        return current_ops().linear_silu_and_mul(x, layer.weight, layer.bias)

    def apply(self, layer: Linear, x: paddle.Tensor) -> paddle.Tensor:
        return current_ops().linear(x, layer.weight, layer.bias)


class Linear(nn.Layer):
    """``y = x @ W (+ b)`` with ``W [input_size, output_size]``, computed by its quant method.

    Args:
        input_size / output_size: feature sizes.
        bias: whether the layer has a bias.
        quant_config: object with ``get_quant_method(layer, prefix)`` returning a
            :class:`LinearMethodBase` (or ``None`` for unquantized); ``None`` = float32.
        prefix: the layer's checkpoint name prefix (quantizers may skip some layers by name).
        tp: under tensor parallelism (:mod:`~fastdeploy_core.layers.parallel`), ``"column"``
            keeps this rank's share of the outputs, ``"row"`` its share of the inputs and sums
            the ranks' partial outputs (all-reduce); ``None`` keeps the whole layer on every rank.
        tp_range: the share (``[start, stop)`` of the split axis) when the caller decides it
            (attention heads); else an even split in whole units of up to 128.
        tp_rows: a column-parallel layer loaded in parts (merged layers): checkpoint rows kept
            per ``shard_id``; ``output_size`` is then already this rank's.

    ``input_size`` / ``output_size`` are then this rank's sizes; the weight loaders take the
    checkpoint's whole tensor and keep only the rank's rows or columns (a view: a memory-mapped
    checkpoint reads only those), so no rank holds the whole weight.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config=None,
        prefix: str = "",
        tp: str | None = None,
        tp_range: tuple[int, int] | None = None,
        tp_rows: dict | None = None,
    ):
        super().__init__()
        self.full_input_size = int(input_size)
        self.has_bias = bool(bias)
        self.prefix = prefix
        group = tp_group()
        self.tp_mode = tp if group.size > 1 else None
        self.tp_rows: dict | None = None  # shard id -> checkpoint rows kept
        self.tp_cols: tuple[int, int] | None = None  # checkpoint inputs kept
        if self.tp_mode == "column" and tp_rows is not None:
            self.tp_rows = tp_rows
        elif self.tp_mode == "column":
            share = tp_range or partition(output_size, group.size, group.rank, split_unit(output_size, group.size))
            self.tp_rows = {None: share}
            output_size = share[1] - share[0]
        elif self.tp_mode == "row":
            self.tp_cols = tp_range or partition(input_size, group.size, group.rank, split_unit(input_size, group.size))
            input_size = self.tp_cols[1] - self.tp_cols[0]
        elif self.tp_mode not in (None, "column"):
            raise ValueError(f"tp must be 'column', 'row' or None, not {tp!r}")
        self.input_size = int(input_size)
        self.output_size = int(output_size)
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self)
        if self.tp_mode is not None:
            for param in self.parameters(include_sublayers=False):
                if getattr(param, "weight_loader", None) is not None:
                    param.weight_loader = self._rank_share_loader(param.weight_loader)

    def _rank_share_loader(self, load):
        """``load`` given only this rank's share of each checkpoint tensor. A row-parallel bias
        is added once: rank 0 keeps it, the others load zeros (the all-reduce sums the ranks)."""

        def load_share(param, loaded, shard_id=None) -> None:
            if self.tp_rows is not None:
                loaded = take_rows(loaded, *self.tp_rows[shard_id])
            if self.tp_cols is not None:
                if getattr(loaded, "ndim", 2) == 1 and param is self.bias:
                    loaded = loaded if tp_group().rank == 0 else np.zeros_like(np.asarray(loaded))
                else:
                    loaded = take_columns(loaded, *self.tp_cols, self.full_input_size, self.prefix or "linear")
            load(param, loaded, shard_id)

        return load_share

    def weight_loader(self, param: paddle.Tensor, loaded, shard_id=None) -> None:
        """Load a checkpoint weight ``[out, in]`` (transposed here) or bias ``[out]``."""
        array = as_float32(loaded)
        if array.ndim == 2:
            array = array.T
        if tuple(array.shape) != tuple(param.shape):
            raise ModelLoadError(
                f"{self.prefix or 'linear'}: checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                f"a layer of {self.input_size} -> {self.output_size}"
            )
        param.set_value(array)

    @property
    def takes_bf16_rows(self) -> bool:
        """Whether :meth:`forward` takes bfloat16 rows as well as float32 (its method's say)."""
        return bool(getattr(self.quant_method, "takes_bf16_rows", False))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.tp_mode == "row":
            return tp_group().all_reduce(self.quant_method.apply(self, x))
        return self.quant_method.apply(self, x)

    def forward_silu_and_mul(self, x: paddle.Tensor) -> paddle.Tensor:
        """SwiGLU of this projection's output halves (gate, up): ``silu_and_mul(forward(x))``."""
        if self.tp_mode == "row":  # the halves of a partial sum are not the gate and up values
            return current_ops().silu_and_mul(self.forward(x))
        return self.quant_method.apply_silu_and_mul(self, x)


class MergedColumnLinear(Linear):
    """Several projections of one input, concatenated on the output axis: one matmul.

    Args:
        output_sizes: output size of each shard, in order.
        shard_names: optional names of the shards (e.g. ``("q", "k", "v")``); the
            ``shard_id`` given to :meth:`weight_loader` is a name or an index.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        quant_config=None,
        prefix: str = "",
        shard_names: Sequence[str] | None = None,
        tp: str | None = None,
        tp_shares: Sequence[tuple[int, int]] | None = None,
    ):
        self.output_sizes = [int(s) for s in output_sizes]
        self.shard_names = list(shard_names) if shard_names is not None else [str(i) for i in range(len(output_sizes))]
        if len(self.shard_names) != len(self.output_sizes):
            raise ValueError("shard_names and output_sizes must have the same length")
        group = tp_group()
        rows = None
        if tp == "column" and group.size > 1:
            # each part split on its own: this rank's rows of q, of k, of v (or of gate, of up)
            shares = list(tp_shares) if tp_shares is not None else [
                partition(size, group.size, group.rank, split_unit(size, group.size)) for size in self.output_sizes
            ]
            rows = {}
            for index, (name, share) in enumerate(zip(self.shard_names, shares)):
                rows[name] = rows[index] = share
            self.output_sizes = [stop - start for start, stop in shares]
        elif tp not in (None, "column"):
            raise ValueError(f"a merged column layer splits its outputs: tp must be 'column' or None, not {tp!r}")
        offsets = [0]
        for size in self.output_sizes:
            offsets.append(offsets[-1] + size)
        self.shard_offsets = offsets
        super().__init__(
            input_size, offsets[-1], bias=bias, quant_config=quant_config, prefix=prefix, tp=tp, tp_rows=rows
        )

    def shard_range(self, shard_id) -> tuple[int, int]:
        """Output columns ``[start, stop)`` of shard ``shard_id`` (name or index)."""
        index = self.shard_names.index(shard_id) if isinstance(shard_id, str) else int(shard_id)
        return self.shard_offsets[index], self.shard_offsets[index + 1]

    def weight_loader(self, param: paddle.Tensor, loaded, shard_id=None) -> None:
        """Load one shard's checkpoint weight ``[out_i, in]`` (or bias ``[out_i]``) into its columns."""
        if shard_id is None:
            return super().weight_loader(param, loaded)
        start, stop = self.shard_range(shard_id)
        array = as_float32(loaded)
        expected = (stop - start, self.input_size) if array.ndim == 2 else (stop - start,)
        if tuple(array.shape) != expected:
            raise ModelLoadError(
                f"{self.prefix or 'linear'} shard {shard_id!r}: checkpoint tensor of shape "
                f"{tuple(array.shape)}, expected {expected}"
            )
        value = paddle.to_tensor(array.T if array.ndim == 2 else array)
        if array.ndim == 2:
            param[:, start:stop] = value
        else:
            param[start:stop] = value


class QKVLinear(MergedColumnLinear):
    """The fused Q/K/V projection of attention: shards ``"q"``, ``"k"``, ``"v"``."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        quant_config=None,
        prefix: str = "",
        tp: str | None = None,
    ):
        self.head_dim = head_dim
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        #: this rank's heads (all of them without tensor parallelism)
        self.heads = head_share(num_heads, num_kv_heads) if tp == "column" else HeadShare(0, num_heads, 0, num_kv_heads)
        self.num_heads = self.heads.num_heads
        self.num_kv_heads = self.heads.num_kv_heads
        q = (self.heads.q_start * head_dim, self.heads.q_stop * head_dim)
        kv = (self.heads.kv_start * head_dim, self.heads.kv_stop * head_dim)
        super().__init__(
            hidden_size, sizes, bias=bias, quant_config=quant_config, prefix=prefix, shard_names=("q", "k", "v"),
            tp=tp, tp_shares=(q, kv, kv),
        )
