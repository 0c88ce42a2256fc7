"""EngineArgs: flat keys routed to sections; every bad value named with the range allowed."""

from __future__ import annotations

import pytest

from fastdeploy_core.config import EngineArgs, QuantizationConfig
from fastdeploy_core.errors import ConfigError


def test_flat_keys_land_in_their_sections_and_round_trip():
    args = EngineArgs.create(model="/m", max_num_seqs=8, block_size=16, device="cpu", quantization="wint8")
    assert args.model.model == "/m"
    assert args.scheduler.max_num_seqs == 8
    assert args.cache.block_size == 16
    assert args.parallel.device == "cpu"
    assert args.quant.parsed() == {"quantization": "wint8"}
    flat = args.flat()
    assert flat["max_num_seqs"] == 8 and flat["block_size"] == 16 and flat["enable_prefix_caching"] is True
    assert EngineArgs.create(**flat) == args


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_num_seqs": 0}, "max_num_seqs: got 0; must be >= 1"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization: got 1.5; must be <= 1.0"),
        ({"block_size": "big"}, "block_size: got 'big'"),
        ({"model_impl": "torch"}, "model_impl: got 'torch'; must be one of 'auto', 'fastdeploy' or 'paddleformers'"),
        ({"max_num_sqs": 4}, "max_num_sqs: unknown setting (given 4); check the spelling"),
        ({"port": 0}, "port: unknown setting"),  # server settings are not engine settings
        (
            {"max_model_len": 4096, "max_num_batched_tokens": 512, "enable_chunked_prefill": False},
            "max_num_batched_tokens (512) is below max_model_len (4096) with chunked prefill off",
        ),
        ({"speculative_config": "{not json"}, "speculative_config: '{not json' is not valid JSON"),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 9}},
            "speculative_config.num_speculative_tokens: got 9; must be <= 8",
        ),
    ],
)
def test_validation_errors_name_field_value_and_range(kwargs, message):
    with pytest.raises(ConfigError) as info:
        EngineArgs.create(**kwargs)
    assert message in str(info.value)


def test_quantization_json_is_parsed_and_bad_json_explained():
    cfg = QuantizationConfig(quantization='{"quantization": "mix_quant", "dense_quant_type": "wint8"}')
    assert cfg.parsed() == {"quantization": "mix_quant", "dense_quant_type": "wint8"}
    with pytest.raises(ConfigError, match="is not valid JSON"):
        QuantizationConfig(quantization="{wint8").parsed()
    with pytest.raises(ConfigError, match="must be an object"):
        QuantizationConfig(quantization="[1]").parsed()
