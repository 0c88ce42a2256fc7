"""YaRN rope scaling: the cos/sin cache equals transformers' (inverse frequencies and the
attention factor on cos and sin), and a config without its required fields is a load error."""

from __future__ import annotations

import numpy as np
import pytest

from fastdeploy_core.errors import ModelLoadError
from fastdeploy_core.layers.rotary import build_cos_sin_cache, rope_attention_factor, rope_settings

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "params",
    [
        {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.7},
        {
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        {"factor": 8.0, "original_max_position_embeddings": 128, "truncate": False},
        {"factor": 2.0, "original_max_position_embeddings": 128, "attention_factor": 1.3},
    ],
)
def test_yarn_cache_matches_transformers(params):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **params}
    config = transformers.DeepseekV3Config(qk_rope_head_dim=16, max_position_embeddings=512, rope_parameters=rope)
    hf = DeepseekV3RotaryEmbedding(config)
    positions = torch.arange(300)[None, :]
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions)
    theta, scaling = rope_settings(config.to_dict())
    cache = build_cos_sin_cache(16, 300, theta, scaling)
    np.testing.assert_allclose(cache[:, 0, :], cos[0].numpy(), atol=2e-6, rtol=0)
    np.testing.assert_allclose(cache[:, 1, 8:], sin[0, :, 8:].numpy(), atol=2e-6, rtol=0)
    assert rope_attention_factor(scaling) == pytest.approx(hf.attention_scaling, rel=1e-12)


def test_yarn_without_its_fields_is_a_load_error():
    with pytest.raises(ModelLoadError, match="'original_max_position_embeddings'"):
        build_cos_sin_cache(8, 16, 10000.0, {"rope_type": "yarn", "factor": 2.0})
