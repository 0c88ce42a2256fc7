"""Resolving --quantization: names, JSON, mix_quant, checkpoint configs, device checks, third-party methods."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import json

import pytest

from fastdeploy_core.devices import Availability, Device
from fastdeploy_core.builtin.cpu.device import CpuDevice
from fastdeploy_core.errors import ConfigError, QuantizationError
from fastdeploy_core.plugins import PluginManager, load_plugins
from fastdeploy_core.quantization.fp8 import BlockWiseFP8
from fastdeploy_core.quantization.kv_cache import Int8KVCacheQuantizer
from fastdeploy_core.quantization.mix_quant import MixQuant
from fastdeploy_core.quantization.registry import parse_spec, resolve_quantization
from fastdeploy_core.quantization.weight_only import WeightOnlyInt4, WeightOnlyInt8
from tests.core.fake_dists import make_dist, run_python


@pytest.fixture(scope="module")
def pm():
    return load_plugins()


def test_every_builtin_method_resolves_by_name(pm):
    for name in ("wint8", "wint4", "w8a8", "w4a8", "block_wise_fp8"):
        q = resolve_quantization(name, device=CpuDevice, plugin_manager=pm)
        assert q.name == name
    assert resolve_quantization(None, plugin_manager=pm) is None
    assert resolve_quantization("  ", plugin_manager=pm) is None


def test_json_settings_reach_the_method(pm):
    q = resolve_quantization('{"quantization": "wint4", "group_size": 64, "has_zero_point": false}', plugin_manager=pm)
    assert isinstance(q, WeightOnlyInt4) and q.config.group_size == 64 and not q.config.has_zero_point
    q = resolve_quantization({"quantization": "block_wise_fp8", "weight_block_size": [64, 64]}, plugin_manager=pm)
    assert q.block == (64, 64)


def test_mix_quant_routes_dense_and_moe_layers_and_kv_cache(pm):
    spec = json.dumps(
        {
            "quantization": "mix_quant",
            "dense_quant_type": "wint8",
            "moe_quant_type": "wint4",
            "kv_cache_quant_type": "int8",
        }
    )
    q = resolve_quantization(spec, device=CpuDevice, plugin_manager=pm)
    assert isinstance(q, MixQuant)
    assert isinstance(q.get_quant_method(None, "model.layers.0.mlp.down_proj"), WeightOnlyInt8)
    assert isinstance(q.get_quant_method(None, "model.layers.0.mlp.experts.3.down_proj"), WeightOnlyInt4)
    assert isinstance(q.kv_cache_method, Int8KVCacheQuantizer)
    assert q.required_methods() == ["wint8", "wint4"]


def test_kv_cache_only_json_quantizes_just_the_cache(pm):
    q = resolve_quantization('{"kv_cache_quant_type": "int8"}', device=CpuDevice, plugin_manager=pm)
    assert q.get_quant_method(None, "model.layers.0.mlp.down_proj") is None
    assert isinstance(q.kv_cache_method, Int8KVCacheQuantizer)
    q = resolve_quantization('{"quantization": "wint8", "kv_cache_quant_type": "int8"}', plugin_manager=pm)
    assert isinstance(q, WeightOnlyInt8) and q.kv_cache_method is not None


@pytest.mark.parametrize(
    "spec, message",
    [
        ('{"quantization": "wint8",', r"not valid JSON .*column"),
        ('["wint8"]', "must be an object, got list"),
        ('{"group_size": 64}', 'names no method: add "quantization"'),
        ('{"quantization": 8}', "must be a method name"),
        ('{"quantization": "wint4", "group_size": 0}', r"'wint4': group_size: .*greater than or equal to 2.*given 0"),
        ('{"quantization": "wint4", "group_size": 33}', "group_size must be even"),
        (
            '{"quantization": "wint8", "bits": 3}',
            r"bits: Extra inputs are not permitted.*its settings are: .*group_size",
        ),
        ('{"quantization": "mix_quant"}', "needs at least one of dense_quant_type"),
        ('{"quantization": "mix_quant", "dense_quant_type": "wint9"}', "unknown quantization method 'wint9'"),
        ('{"quantization": "block_wise_fp8", "weight_block_size": [128]}', "weight_block_size.*two positive integers"),
    ],
)
def test_malformed_configs_give_clear_errors(pm, spec, message):
    with pytest.raises(QuantizationError, match=message) as info:
        resolve_quantization(spec, plugin_manager=pm)
    assert isinstance(info.value, ConfigError) and info.value.http_status == 400


def test_unknown_method_lists_the_registered_ones(pm):
    with pytest.raises(QuantizationError) as info:
        resolve_quantization("awq", plugin_manager=pm)
    msg = str(info.value)
    assert "unknown quantization method 'awq'" in msg
    for name in ("block_wise_fp8", "mix_quant", "w4a8", "w8a8", "wint4", "wint8"):
        assert name in msg


class _Int8OnlyChip(Device):
    name = "int8chip"
    paddle_device_type = "cpu"
    quantization_methods = ("wint8",)

    @classmethod
    def detect(cls):
        return Availability.yes()


class _NoQuantChip(Device):
    name = "plainchip"
    paddle_device_type = "cpu"

    @classmethod
    def detect(cls):
        return Availability.yes()


def _manager_with_chips() -> PluginManager:
    from fastdeploy_core.builtin import plugin as builtin

    manager = PluginManager()
    manager.add_plugin(builtin, "builtin", "fastdeploy-core", "test")

    class chips:  # a plugin module stand-in
        FD_PLUGIN_API_VERSION = builtin.FD_PLUGIN_API_VERSION

        @staticmethod
        def register_devices(register):
            register(_Int8OnlyChip)
            register(_NoQuantChip)

    from fastdeploy_core.hookspecs import hookimpl

    chips.register_devices = hookimpl(chips.register_devices)
    manager.add_plugin(chips, "chips", "fd-chips", "1.0")
    manager.run_registration_hooks()
    return manager


def test_device_that_cannot_run_a_method_names_the_devices_that_can():
    manager = _manager_with_chips()
    assert resolve_quantization("wint8", device=_Int8OnlyChip, plugin_manager=manager).name == "wint8"
    with pytest.raises(QuantizationError) as info:
        resolve_quantization("wint4", device=_Int8OnlyChip, plugin_manager=manager)
    msg = str(info.value)
    assert "'wint4' is not supported on device 'int8chip'" in msg and "it runs: wint8" in msg
    assert "devices that run it: cpu" in msg
    with pytest.raises(
        QuantizationError, match="'wint8' is not supported on device 'plainchip'.*devices that run it: cpu, int8chip"
    ):
        resolve_quantization("wint8", device=_NoQuantChip, plugin_manager=manager)
    # mix_quant checks each part
    with pytest.raises(QuantizationError, match="'wint4' is not supported on device 'int8chip'"):
        resolve_quantization(
            '{"quantization": "mix_quant", "dense_quant_type": "wint8", "moe_quant_type": "wint4"}',
            device=_Int8OnlyChip,
            plugin_manager=manager,
        )


def test_checkpoint_quantization_config_is_honoured(pm):
    fp8_ckpt = {
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    }
    q = resolve_quantization(None, plugin_manager=pm, hf_config=fp8_ckpt)
    assert isinstance(q, BlockWiseFP8) and q.config.is_quantized and q.block == (128, 128)
    fd_ckpt = {"quantization_config": {"quantization": "wint8"}}
    q = resolve_quantization("wint8", plugin_manager=pm, hf_config=fd_ckpt)
    assert isinstance(q, WeightOnlyInt8) and q.config.is_quantized
    with pytest.raises(QuantizationError, match="already quantized with 'wint8'.*drop --quantization or pass 'wint8'"):
        resolve_quantization("wint4", plugin_manager=pm, hf_config=fd_ckpt)
    with pytest.raises(QuantizationError, match="names no method"):
        resolve_quantization(None, plugin_manager=pm, hf_config={"quantization_config": {"bits": 4}})


def test_gguf_checkpoints_switch_wint_methods_to_groups_of_32(pm):
    q = resolve_quantization("wint4", plugin_manager=pm).for_gguf({"Q4_1"})
    assert q.config.group_size == 32 and q.accepts_gguf("Q4_1")
    # an explicit group size wins (the blocks are then dequantized and requantized)
    q = resolve_quantization('{"quantization": "wint4", "group_size": 128}', plugin_manager=pm).for_gguf({"Q4_1"})
    assert q.config.group_size == 128 and not q.accepts_gguf("Q4_1")
    # Q4_1 linears cannot be held by int8 storage as stored: per-channel int8 from the float values
    q = resolve_quantization("wint8", plugin_manager=pm).for_gguf({"Q4_1"})
    assert q.config.group_size is None and not q.accepts_gguf("Q4_1")
    q = resolve_quantization("wint8", plugin_manager=pm).for_gguf({"Q8_0"})
    assert q.config.group_size == 32 and q.accepts_gguf("Q8_0")


def test_parse_spec_keeps_dicts_and_names():
    assert parse_spec("wint8") == {"quantization": "wint8"}
    assert parse_spec({"quantization": "w8a8"}) == {"quantization": "w8a8"}


THIRD_PARTY = '''
import paddle
from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import hookimpl
from fastdeploy_core.quantization.weight_only import WeightOnlyInt8
from fastdeploy_core.quantization.codes import quantize_int8

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION


class PerTensorInt8(WeightOnlyInt8):
    """One scale for the whole tensor: a method the core does not ship."""

    name = "wint8_per_tensor"
    device_op = None  # runs its reference formula on any device
    requires_device_support = {requires}

    def quantize(self, weight):
        out = quantize_int8(weight, weight.shape[0])
        scale = out["weight_scale"].max()
        codes = (weight / scale).round().clip(-127, 127).astype("int8")
        return {{"weight": codes, "weight_scale": out["weight_scale"] * 0 + scale}}


@hookimpl
def register_quantizers(register):
    register("wint8_per_tensor", PerTensorInt8)
'''

RESOLVE = """
import numpy as np, paddle
from fastdeploy_core.builtin.cpu.device import CpuDevice
from fastdeploy_core.errors import QuantizationError
from fastdeploy_core.layers.linear import Linear
from fastdeploy_core.plugins import load_plugins
from fastdeploy_core.quantization.registry import resolve_quantization, describe_methods
pm = load_plugins()
try:
    q = resolve_quantization("wint8_per_tensor", device=CpuDevice, plugin_manager=pm)
except QuantizationError as exc:
    print("ERROR", exc)
    raise SystemExit(0)
layer = Linear(64, 16, quant_config=q, prefix="x.o_proj")
w = np.random.default_rng(0).standard_normal((16, 64)).astype("float32")
layer.weight.weight_loader(layer.weight, w)
x = np.ones((1, 64), "float32")
y = layer(paddle.to_tensor(x)).numpy()
print("OK", type(q).__name__, describe_methods(pm)["wint8_per_tensor"]["plugin"],
      len(set(layer.weight_scale.numpy().ravel().tolist())), float(np.abs(y - x @ w.T).max() / np.abs(x @ w.T).max()))
"""


@pytest.mark.parametrize("requires", [False, True])
def test_third_party_quantizer_from_a_plugin_is_selectable_by_name(tmp_path, requires):
    make_dist(tmp_path, "fd-pertensor", "fd_pertensor", "pertensor", THIRD_PARTY.format(requires=requires))
    proc = run_python(RESOLVE, tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip().splitlines()[-1]
    if requires:
        # declared as needing device support, and no installed device declares it
        assert out.startswith("ERROR") and "'wint8_per_tensor' is not supported on device 'cpu'" in out
        assert "no installed device runs it" in out
    else:
        kind, cls, plugin, n_scales, err = out.split()
        assert (kind, cls, plugin, n_scales) == ("OK", "PerTensorInt8", "pertensor", "1")
        assert float(err) < 0.05


def test_a_plugin_left_out_by_the_allow_list_is_unknown(tmp_path):
    make_dist(tmp_path, "fd-pertensor", "fd_pertensor", "pertensor", THIRD_PARTY.format(requires=False))
    proc = run_python(RESOLVE, tmp_path, plugins="")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip().splitlines()[-1]
    assert out.startswith("ERROR unknown quantization method 'wint8_per_tensor'") and "FD_PLUGINS" in out
