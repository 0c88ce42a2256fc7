"""Generation through the engine with each quantization method: a tiny random Llama and the default model."""

from __future__ import annotations

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.engine.engine_core import EngineCore
from fastdeploy_core.engine.outputs import EngineCoreRequest
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.errors import QuantizationError
from fastdeploy_core.quantization.base import QuantizerBase
from fastdeploy_core.quantization.kv_cache import QuantizedKVCache
from fastdeploy_core.quantization.weight_only import WeightOnlyInt8

PROMPTS = [[5, 9, 17, 33, 2, 7, 100, 64, 3], [1], [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101], [12, 12, 12, 30]]
MAX_NEW = 10

METHODS = {
    "wint8": "wint8",
    "wint4": "wint4",
    "w8a8": "w8a8",
    "w4a8": "w4a8",
    "block_wise_fp8": "block_wise_fp8",
    "kv_int8": '{"kv_cache_quant_type": "int8"}',
    "mix_wint8_kv_int8": json.dumps(
        {"quantization": "mix_quant", "dense_quant_type": "wint8", "kv_cache_quant_type": "int8"}
    ),
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer Llama (GQA) with random weights, written as an HF safetensors directory."""
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("tiny_llama")
    hidden, inter, layers, heads, kv_heads, vocab = 128, 256, 2, 4, 2, 128
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)

    def w(*shape, gain=1.0):
        return (rng.standard_normal(shape) * gain / np.sqrt(shape[-1])).astype(np.float32)

    # unit-gain layers and a sharp head: logits far apart, as in a trained model
    tensors = {
        "model.embed_tokens.weight": w(vocab, hidden, gain=np.sqrt(hidden)),
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": w(vocab, hidden, gain=6.0),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": np.ones(hidden, np.float32),
                p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": w(inter, hidden),
                p + "mlp.up_proj.weight": w(inter, hidden),
                p + "mlp.down_proj.weight": w(hidden, inter),
            }
        )
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def make_core(path: str, **kw) -> EngineCore:
    settings = {"model": path, "max_model_len": 64, "block_size": 4, "num_gpu_blocks_override": 96}
    settings.update(kw)
    return EngineCore(EngineArgs.create(**settings))


def generate(core: EngineCore) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
    got: dict[str, list[int]] = {}
    steps = 0
    while core.has_unfinished_requests():
        steps += 1
        assert steps < 1000
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return [got[f"r{i}"] for i in range(len(PROMPTS))]


def teacher_forced(core: EngineCore, sequences: list[list[int]]) -> list[list[dict[int, float]]]:
    """Per sequence, the model's top-1 plus the given token's logprob at every position after the first."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
    for i, seq in enumerate(sequences):
        core.add_request(EngineCoreRequest(f"t{i}", seq, params))
    got: dict[str, list] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.prompt_logprobs is not None:
                got[out.request_id] = out.prompt_logprobs[1:]
    return [got[f"t{i}"] for i in range(len(sequences))]


@pytest.fixture(scope="module")
def float_run(tiny_dir):
    """Float32 greedy tokens and, teacher-forced on prompt + those tokens, the float logprobs."""
    core = make_core(tiny_dir)
    tokens = generate(core)
    sequences = [p + t for p, t in zip(PROMPTS, tokens)]
    return tokens, sequences, teacher_forced(core, sequences)


#: Teacher-forced on the float32 run's sequences: the fraction of generated positions where the
#: method's top-1 token is the float one, and the mean |logprob difference| of that token.
BARS = {  # measured on this model: wint8 1.0/0.015, w8a8 1.0/0.03, fp8 0.95/0.07, kv 0.975/0.007,
    # wint4 0.68/0.45, w4a8 0.75/0.61 (random Gaussian weights are the hard case for 4 bits)
    "wint8": (0.95, 0.04),
    "w8a8": (0.95, 0.08),
    "block_wise_fp8": (0.9, 0.15),
    "kv_int8": (0.95, 0.03),
    "mix_wint8_kv_int8": (0.95, 0.05),
    "wint4": (0.55, 0.8),
    "w4a8": (0.55, 0.9),
}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_tiny_model_generates_with_each_method(tiny_dir, float_run, name):
    core = make_core(tiny_dir, quantization=METHODS[name])
    runner = core.runner
    model = runner.model
    linears = [
        layer for layer in model.model.sublayers() if isinstance(getattr(layer, "quant_method", None), QuantizerBase)
    ]
    assert len(linears) == (0 if name == "kv_int8" else 2 * 4)  # qkv, o, gate_up, down per layer
    # weight-only methods keep the LM head in per-channel int8 (mix_quant only when asked)
    head_is_int8 = isinstance(model.lm_head.quant_method, WeightOnlyInt8)
    assert head_is_int8 == (name not in ("kv_int8", "mix_wint8_kv_int8"))
    assert isinstance(runner.kv_caches[0][0], QuantizedKVCache) == ("kv_int8" in name)
    tokens = generate(core)
    assert [len(t) for t in tokens] == [MAX_NEW] * len(PROMPTS)
    assert generate(core) == tokens  # deterministic, also with prefix-cache hits the second time
    assert_within_bars(core, float_run, name)


def assert_within_bars(core: EngineCore, float_run, name: str) -> None:
    """Teacher-forced on the float run's sequences, ``core`` meets ``BARS[name]`` and differs
    from float32 at all (so the method really ran)."""
    _, sequences, float_lp = float_run
    quant_lp = teacher_forced(core, sequences)
    agree, diffs = [], []
    for prompt, seq, fl, ql in zip(PROMPTS, sequences, float_lp, quant_lp):
        for pos in range(len(prompt) - 1, len(seq) - 1):  # entries predicting the generated tokens
            token = seq[pos + 1]
            agree.append(max(ql[pos], key=ql[pos].get) == token)
            diffs.append(abs(ql[pos][token] - fl[pos][token]))
    min_agree, max_diff = BARS[name]
    assert np.mean(agree) >= min_agree and np.mean(diffs) <= max_diff, (name, np.mean(agree), np.mean(diffs))
    assert np.mean(diffs) > 0, "quantized logprobs equal the float ones: nothing was quantized"


def test_engine_refuses_an_unknown_method_before_loading(tiny_dir):
    with pytest.raises(QuantizationError, match="unknown quantization method 'int3'.*wint8"):
        make_core(tiny_dir, quantization="int3")
    with pytest.raises(QuantizationError, match="not valid JSON"):
        make_core(tiny_dir, quantization='{"quantization": ')


@pytest.mark.parametrize(
    "spec",
    ["wint8", "wint4", json.dumps({"quantization": "block_wise_fp8", "kv_cache_quant_type": "int8"})],
    ids=["wint8", "wint4_from_q4_1_blocks", "fp8_kv_int8"],
)
@pytest.mark.slow
def test_default_model_answers_with_each_method(spec):
    from fastdeploy_core import LLM

    llm = LLM(model=None, max_model_len=256, num_gpu_blocks_override=16, quantization=spec)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=12)
    )
    text = out[0].outputs[0].text
    assert "Paris" in text, text


@pytest.mark.slow
def test_default_model_wint4_holds_the_gguf_weights_exactly():
    """Q4_1 blocks load as stored: with a float32 LM head, wint4 computes what float32 does."""
    from fastdeploy_core import LLM

    prompts = ["What is the capital of France?", "Name a red fruit."]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    answers, weights = {}, {}
    for name, spec in (("wint4", '{"quantization": "wint4", "lm_head_quant_type": null}'), ("float32", None)):
        kw = {"quantization": spec} if spec else {}
        llm = LLM(model=None, max_model_len=256, num_gpu_blocks_override=16, **kw)
        model = llm.engine.core.runner.model
        answers[name] = [llm.chat([{"role": "user", "content": p}], params)[0].outputs[0].token_ids for p in prompts]
        weights[name] = sum(int(np.prod(t.shape)) * t.element_size() for t in model.parameters())
        weights[name] += sum(int(np.prod(t.shape)) * t.element_size() for t in model.buffers())
        if name == "wint4":
            qkv = model.model.layers[0].self_attn.qkv_proj
            assert qkv.quant_method.config.group_size == 32 and qkv.weight.dtype == paddle.uint8
        del llm, model
    assert answers["wint4"] == answers["float32"]
    assert weights["wint4"] < 0.65 * weights["float32"]


def test_kv_cache_dtype_int8_flag_uses_the_int8_cache(tiny_dir, float_run):
    float_tokens, _, _ = float_run
    core = make_core(tiny_dir, kv_cache_dtype="int8")
    assert isinstance(core.runner.kv_caches[0][0], QuantizedKVCache)
    assert core.runner.bytes_per_block == 2 * 2 * 4 * 2 * (32 + 4)  # K+V, 2 layers, 4 slots, 2 heads
    assert core.runner.kv_caches[0][0].data.dtype == paddle.int8
    assert [len(t) for t in generate(core)] == [len(t) for t in float_tokens]
    # the same bar as the kv_cache_quant_type route to the same cache (teacher-forced, so one
    # early flip does not hide or excuse the rest)
    assert_within_bars(core, float_run, "kv_int8")
