"""The PaddleFormers fallback served by the engine, against transformers and the native Llama.

Tiny random checkpoints are built and saved by transformers in a subprocess
(:mod:`hf_reference`), which also records transformers' greedy tokens: importing PaddleFormers
in this process hides torch from transformers, so no reference is computed here.

Run them with PaddleFormers installed (see the plugin's README for the install that keeps the
core's pins); without it the module is skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest

_MISSING = [name for name in ("paddleformers", "torch", "transformers") if importlib.util.find_spec(name) is None]
if _MISSING:
    pytest.skip(
        f"{', '.join(_MISSING)} not installed: the fallback tests need PaddleFormers (install it as "
        "plugins/fd-paddleformers/README.md says) and torch + transformers for the references",
        allow_module_level=True,
    )

from fastdeploy_core.config import EngineArgs  # noqa: E402
from fastdeploy_core.engine.engine_core import EngineCore  # noqa: E402
from fastdeploy_core.engine.outputs import EngineCoreRequest  # noqa: E402
from fastdeploy_core.engine.sampling_params import SamplingParams  # noqa: E402
from fastdeploy_core.errors import UnsupportedArchitectureError  # noqa: E402
from fastdeploy_core.plugins import load_plugins  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict:
    """Checkpoint paths and transformers' greedy tokens, from a clean subprocess."""
    out = tmp_path_factory.mktemp("pf_checkpoints")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "hf_reference.py"), str(out)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "reference.json") as f:
        return json.load(f)


def make_core(path: str, **kw) -> EngineCore:
    settings = dict(model=path, max_model_len=128, block_size=4, num_gpu_blocks_override=256)
    settings.update(kw)
    return EngineCore(EngineArgs.create(**settings))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run(core: EngineCore, requests: list[tuple[str, list[int]]], max_tokens: int) -> dict:
    """Submit all, step to the end; {request id: [EngineCoreOutput, ...]}; checks no block leaks."""
    for rid, prompt in requests:
        core.add_request(EngineCoreRequest(rid, prompt, greedy(max_tokens)))
    outs: dict = {}
    steps = 0
    while core.has_unfinished_requests():
        steps += 1
        assert steps < 10_000
        for out in core.step():
            outs.setdefault(out.request_id, []).append(out)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks, "KV blocks leaked"
    return outs


def tokens(outs: dict, rid: str) -> list[int]:
    return [t for o in outs[rid] for t in o.new_token_ids]


def served_class(core: EngineCore) -> str:
    return type(core.runner.model).__name__


def test_llama_through_both_implementations_gives_identical_greedy_tokens(ref):
    path, prompts, max_new = ref["paths"]["llama"], ref["prompts"], ref["max_new"]
    native = make_core(path, model_impl="fastdeploy")
    fallback = make_core(path, model_impl="paddleformers")
    assert served_class(native) == "LlamaForCausalLM"
    assert served_class(fallback) == "PaddleFormersForCausalLM"
    for i, prompt in enumerate(prompts):
        got_native = tokens(run(native, [("n", prompt)], max_new), "n")
        got_fallback = tokens(run(fallback, [("f", prompt)], max_new), "f")
        assert got_fallback == got_native == ref["tokens"]["llama"][i], f"prompt {i}"


@pytest.mark.parametrize("name", ["phi3", "ernie4_5"])
def test_architecture_without_native_class_is_served_by_auto_like_transformers(ref, name):
    core = make_core(ref["paths"][name])  # --model-impl auto (the default)
    assert served_class(core) == "PaddleFormersForCausalLM"
    for i, prompt in enumerate(ref["prompts"]):
        got = tokens(run(core, [(f"r{i}", prompt)], ref["max_new"]), f"r{i}")
        assert got == ref["tokens"][name][i], f"{name} prompt {i}"


@pytest.mark.parametrize(
    "settings",
    [
        dict(),  # every prompt in one batch
        dict(max_num_batched_tokens=5),  # chunked prefill in small pieces, mixed with decodes
        dict(enable_prefix_caching=False, max_num_seqs=2),
    ],
    ids=["batched", "chunked", "two_seqs_no_prefix_cache"],
)
@pytest.mark.parametrize("name", ["phi3", "ernie4_5"])
def test_batching_and_chunked_prefill_give_the_tokens_of_alone(ref, name, settings):
    core = make_core(ref["paths"][name], **settings)
    prompts = ref["prompts"]
    outs = run(core, [(f"r{i}", p) for i, p in enumerate(prompts)], ref["max_new"])
    for i in range(len(prompts)):
        assert tokens(outs, f"r{i}") == ref["tokens"][name][i], f"{name} prompt {i}"


@pytest.mark.parametrize("name", ["phi3", "ernie4_5"])
def test_prefix_cache_hits_give_the_same_tokens(ref, name):
    core = make_core(ref["paths"][name])
    prompts, expected = ref["prompts"], ref["tokens"][name]
    first = run(core, [("a", prompts[1])], ref["max_new"])
    assert first["a"][0].num_cached_tokens == 0
    again = run(core, [("b", prompts[1]), ("c", prompts[0])], ref["max_new"])
    assert tokens(again, "b") == expected[1] and tokens(again, "c") == expected[0]
    assert again["b"][0].num_cached_tokens == 20  # 5 full blocks of 4 (the last prompt token is recomputed)
    assert again["c"][0].num_cached_tokens == 8  # the shared 9-token prefix: 2 full blocks


def test_model_impl_fastdeploy_without_native_class_is_a_clear_error(ref):
    with pytest.raises(UnsupportedArchitectureError) as info:
        make_core(ref["paths"]["phi3"], model_impl="fastdeploy")
    message = str(info.value)
    assert "no native implementation of 'Phi3ForCausalLM'" in message
    assert "LlamaForCausalLM" in message  # the native architectures are listed
    assert "--model-impl auto or paddleformers" in message


@pytest.mark.parametrize(
    "name, why, impl",
    [
        # Mistral is native (fd-llama) under auto; only the explicit fallback fails.
        ("mistral", "PaddleFormers has no implementation of MistralForCausalLM", "paddleformers"),
        ("qwen2", "paddlefleet", "paddleformers"),  # PaddleFormers' Qwen2 module needs paddlefleet (not on PyPI)
        ("qwen2", "paddlefleet", "auto"),
    ],
)
def test_architecture_paddleformers_cannot_build_is_a_clear_error(ref, name, why, impl):
    with pytest.raises(UnsupportedArchitectureError) as info:
        make_core(ref["paths"][name], model_impl=impl)
    message = str(info.value)
    assert "PaddleFormers fallback cannot serve" in message and why in message


def test_fallback_supports_reports_why(ref):
    from fd_paddleformers.model import PaddleFormersForCausalLM

    def config(name):
        with open(os.path.join(ref["paths"][name], "config.json")) as f:
            return json.load(f)

    ok, why = PaddleFormersForCausalLM.supports(config("ernie4_5"))
    assert ok and "Ernie4_5Model" in why
    ok, why = PaddleFormersForCausalLM.supports(config("mistral"))
    assert not ok and "no implementation of MistralForCausalLM" in why
    windowed = dict(config("phi3"), sliding_window=32)
    ok, why = PaddleFormersForCausalLM.supports(windowed)
    assert not ok and "sliding-window" in why


def test_plugin_registers_the_fallback_for_every_architecture():
    pm = load_plugins()
    target, impl, why = pm.model_provider("Phi3ForCausalLM", "auto")
    assert impl == "paddleformers" and target == "fd_paddleformers.model:PaddleFormersForCausalLM"
    assert "no native implementation of Phi3ForCausalLM" in why
    target, impl, _ = pm.model_provider("LlamaForCausalLM", "auto")
    assert impl == "fastdeploy"


def test_plugin_manager_asks_the_fallback_whether_it_can_serve(ref):
    pm = load_plugins()

    def config(name):
        with open(os.path.join(ref["paths"][name], "config.json")) as f:
            return json.load(f)

    _, impl, why = pm.model_provider("Ernie4_5ForCausalLM", "auto", config("ernie4_5"))
    assert impl == "paddleformers" and "Ernie4_5Model" in why
    with pytest.raises(UnsupportedArchitectureError) as info:
        pm.model_provider("MistralForCausalLM", "paddleformers", config("mistral"))
    message = str(info.value)
    assert "no implementation of MistralForCausalLM" in message and "native architectures: LlamaForCausalLM" in message
    target, impl, _ = pm.model_provider("MistralForCausalLM", "auto", config("mistral"))
    assert impl == "fastdeploy" and target == "fd_llama.llama:LlamaForCausalLM"


@pytest.mark.slow
def test_default_model_through_both_implementations_gives_identical_greedy_tokens():
    """The embedded SmolLM2-135M-Instruct GGUF: 64 greedy tokens, native vs fallback."""
    from fastdeploy_core import LLM

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    results = {}
    for impl in ("fastdeploy", "paddleformers"):
        llm = LLM(model_impl=impl, max_model_len=512, num_gpu_blocks_override=16, max_num_seqs=4)
        assert served_class(llm.engine.core) == {"fastdeploy": "LlamaForCausalLM", "paddleformers": "PaddleFormersForCausalLM"}[impl]
        out = llm.chat(messages, params, use_tqdm=False)[0]
        results[impl] = (list(out.outputs[0].token_ids), out.outputs[0].text)
        del llm
    assert results["paddleformers"][0] == results["fastdeploy"][0]
    assert "The capital of France is Paris." in results["paddleformers"][1]


def first_step_logits(core: EngineCore, prompt: list[int]):
    """The model's logits for the last prompt token, one prefill straight through the runner."""
    import numpy as np
    import paddle

    from fastdeploy_core.executor.forward_meta import ForwardMeta

    runner = core.runner
    num_tokens, block_size = len(prompt), runner.block_size
    num_blocks = -(-num_tokens // block_size)
    meta = ForwardMeta(
        input_ids=paddle.to_tensor(prompt, dtype="int64"),
        positions=paddle.arange(num_tokens, dtype="int64"),
        slot_mapping=paddle.arange(num_tokens, dtype="int64"),  # blocks 0.. of an idle engine
        query_start_loc=np.array([0, num_tokens], dtype=np.int64),
        seq_lens=np.array([num_tokens], dtype=np.int64),
        block_tables=np.arange(num_blocks, dtype=np.int64)[None, :],
        block_size=block_size,
        logits_indices=paddle.to_tensor([num_tokens - 1], dtype="int64"),
    )
    hidden = runner.model(meta, runner.kv_caches)
    return runner.model.compute_logits(paddle.index_select(hidden, meta.logits_indices, axis=0)).numpy()[0]


def test_fallback_linears_take_the_quantization_method(ref):
    """wint8: PaddleFormers' linears (and the embedding) take int8 storage and compute like native wint8.

    Native and fallback wint8 agree to float rounding, far closer than either is to float32, and
    give the same greedy tokens.
    """
    import numpy as np

    path, prompt = ref["paths"]["llama"], ref["prompts"][1]
    native = make_core(path, model_impl="fastdeploy", quantization="wint8")
    fallback = make_core(path, model_impl="paddleformers", quantization="wint8")
    model = fallback.runner.model
    linears = {name: layer for name, layer in model.named_sublayers() if name.endswith("_proj")}
    # q, k, v, o and down, plus gate and up merged into PaddleFormers' fused up_gate_proj
    assert len(linears) == 2 * 6 and "model.layers.1.mlp.up_gate_proj" in linears
    assert all(type(layer.quant_method).__name__ == "WeightOnlyInt8" for layer in linears.values())
    assert all(str(layer.weight.dtype) == "paddle.int8" for layer in linears.values())
    quantized = first_step_logits(fallback, prompt)
    gap_to_native = np.abs(quantized - first_step_logits(native, prompt)).max()
    gap_to_float = np.abs(quantized - first_step_logits(make_core(path, model_impl="paddleformers"), prompt)).max()
    assert gap_to_native < 1e-4 * np.abs(quantized).max()
    assert gap_to_float > 100 * gap_to_native
    assert type(model.model.embed_tokens.quant_method).__name__ == "Int8EmbeddingMethod"
    for i, p in enumerate(ref["prompts"]):
        got_native = tokens(run(native, [("n", p)], ref["max_new"]), "n")
        assert tokens(run(fallback, [("f", p)], ref["max_new"]), "f") == got_native, f"prompt {i}"


def test_fast_rotary_only_replaces_the_rotate_half_form():
    """Llama's rotate_half RoPE gets the cheaper bit-identical form; Ernie 4.5's interleaved one does not."""
    import importlib

    import numpy as np
    import paddle

    from fd_paddleformers.architectures import import_paddleformers
    from fd_paddleformers.rotary import fallback_step, install_fast_rotary

    import_paddleformers()
    llama = importlib.import_module("paddleformers.transformers.llama.modeling")
    importlib.import_module("paddleformers.transformers.ernie4_5.modeling")
    assert install_fast_rotary("paddleformers.transformers.llama.modeling")
    assert not install_fast_rotary("paddleformers.transformers.ernie4_5.modeling")
    fast = llama.apply_rotary_pos_emb
    original = fast._fd_fast_rotary_original
    rng = np.random.default_rng(1)
    q = paddle.to_tensor(rng.standard_normal((1, 6, 3, 32)).astype(np.float32))
    k = paddle.to_tensor(rng.standard_normal((1, 3, 3, 32)).astype(np.float32))
    angles = rng.uniform(0, 50, (1, 3, 16)).astype(np.float32)
    cos = paddle.to_tensor(np.cos(np.concatenate([angles, angles], -1)))
    sin = paddle.to_tensor(np.sin(np.concatenate([angles, angles], -1)))
    with fallback_step():
        got = fast(q, k, cos, sin)
    want = original(q, k, cos, sin)
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(got, want))


@pytest.mark.slow
def test_default_model_wint4_from_gguf_blocks_same_through_both_implementations():
    """GGUF Q4_1 blocks reach the fallback's wint4 linears (gate/up shards included) as for native Llama."""
    from fastdeploy_core import LLM

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for impl in ("fastdeploy", "paddleformers"):
        llm = LLM(model_impl=impl, quantization="wint4", max_model_len=256, num_gpu_blocks_override=8, max_num_seqs=2)
        model = llm.engine.core.runner.model
        methods = {type(layer.quant_method).__name__ for _, layer in model.named_sublayers() if hasattr(layer, "quant_method")}
        assert "WeightOnlyInt4" in methods
        results[impl] = list(llm.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids)
        del llm
    assert results["paddleformers"] == results["fastdeploy"]
