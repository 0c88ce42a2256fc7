"""The PaddleFormers fallback served by the engine, against transformers and the native Llama.

Tiny random checkpoints are built and saved by transformers in a subprocess
(:mod:`hf_reference`), which also records transformers' greedy tokens: importing PaddleFormers
in this process hides torch from transformers, so no reference is computed here.

Run them with PaddleFormers installed (see the plugin's README for the install that keeps the
core's pins); without it the module is skipped. Which families are served depends on the
installed generation (:data:`SERVED`): 0.4 (the default install) builds the Qwen and ERNIE
families, 1.x builds Llama, Phi3 and ERNIE-4.5 and needs ``paddlefleet`` for the Qwen families.
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

from importlib import metadata

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.engine.engine_core import EngineCore
from fastdeploy_core.testing.engine_run import run_to_end
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.errors import UnsupportedArchitectureError
from fastdeploy_core.plugins import load_plugins

HERE = os.path.dirname(os.path.abspath(__file__))
PADDLEFORMERS_VERSION = metadata.version("paddleformers")
GENERATION_04 = PADDLEFORMERS_VERSION.startswith("0.4")
#: checkpoints (hf_reference.CHECKPOINTS) the installed generation serves token-identically to transformers
SERVED = (
    ["qwen3", "qwen2", "qwen3_moe", "ernie4_5", "ernie4_5_moe", "deepseek_v3"]
    if GENERATION_04
    else ["llama", "phi3", "ernie4_5"]
)
MOE = [name for name in SERVED if name.endswith("_moe") or name.startswith("deepseek")]
#: checkpoint -> why the installed generation cannot serve it (a part of the error message)
REFUSED = (
    {
        "mistral": "has no implementation of MistralForCausalLM",
        "phi3": "has no implementation of Phi3ForCausalLM",
        # 0.4's Llama is old-style code that computes attention itself: it would bypass the KV cache
        "llama": "computes attention itself",
    }
    if GENERATION_04
    else {
        "mistral": "has no implementation of MistralForCausalLM",
        "qwen2": "paddlefleet",  # PaddleFormers 1.x's Qwen and DeepSeek modules need paddlefleet (not on PyPI)
        "qwen3": "paddlefleet",
        "deepseek_v3": "cannot provide DeepseekV3Model",  # its modeling imports paddlefleet_ops
    }
)


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict:
    """Checkpoint paths and transformers' greedy tokens, from a clean subprocess."""
    out = tmp_path_factory.mktemp("pf_checkpoints")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    names = sorted(set(SERVED) | set(REFUSED) | ({"deepseek_v3_q_proj"} if GENERATION_04 else set()))
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "hf_reference.py"), str(out), *names],
        capture_output=True,
        text=True,
        check=False,
        env=env,
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
    return run_to_end(core, [(rid, prompt, greedy(max_tokens)) for rid, prompt in requests], outputs=True)


def tokens(outs: dict, rid: str) -> list[int]:
    return [t for o in outs[rid] for t in o.new_token_ids]


def served_class(core: EngineCore) -> str:
    return type(core.runner.model).__name__


@pytest.mark.skipif(GENERATION_04, reason="PaddleFormers 0.4's Llama computes attention itself (refused)")
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


@pytest.mark.parametrize("name", SERVED)
def test_fallback_gives_transformers_greedy_tokens_and_logits(ref, name):
    """Each prompt alone: 32 greedy tokens identical, last-prompt-token logits within 1e-4."""
    import numpy as np

    core = make_core(ref["paths"][name], model_impl="paddleformers")
    assert served_class(core) == "PaddleFormersForCausalLM"
    logits = first_step_logits(core, ref["prompts"][ref["logits_prompt"]])
    assert np.abs(logits - np.array(ref["logits"][name])).max() < 1e-4
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
@pytest.mark.parametrize("name", SERVED)
def test_batching_and_chunked_prefill_give_the_tokens_of_alone(ref, name, settings):
    core = make_core(ref["paths"][name], model_impl="paddleformers", **settings)
    prompts = ref["prompts"]
    outs = run(core, [(f"r{i}", p) for i, p in enumerate(prompts)], ref["max_new"])
    for i in range(len(prompts)):
        assert tokens(outs, f"r{i}") == ref["tokens"][name][i], f"{name} prompt {i}"


@pytest.mark.parametrize("name", SERVED)
def test_prefix_cache_hits_give_the_same_tokens(ref, name):
    core = make_core(ref["paths"][name], model_impl="paddleformers")
    prompts, expected = ref["prompts"], ref["tokens"][name]
    first = run(core, [("a", prompts[1])], ref["max_new"])
    assert first["a"][0].num_cached_tokens == 0
    again = run(core, [("b", prompts[1]), ("c", prompts[0])], ref["max_new"])
    assert tokens(again, "b") == expected[1] and tokens(again, "c") == expected[0]
    assert again["b"][0].num_cached_tokens == 20  # 5 full blocks of 4 (the last prompt token is recomputed)
    assert again["c"][0].num_cached_tokens == 8  # the shared 9-token prefix: 2 full blocks


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_architecture_the_fallback_cannot_serve_is_a_clear_error(ref, name):
    with pytest.raises(UnsupportedArchitectureError) as info:
        make_core(ref["paths"][name], model_impl="paddleformers")
    message = str(info.value)
    assert "PaddleFormers fallback cannot serve" in message and REFUSED[name] in message


def test_fallback_supports_reports_why(ref):
    from fd_paddleformers.model import PaddleFormersForCausalLM

    def config(name):
        with open(os.path.join(ref["paths"][name], "config.json")) as f:
            return json.load(f)

    ok, why = PaddleFormersForCausalLM.supports(config("ernie4_5"))
    assert ok and "Ernie4_5Model" in why
    ok, why = PaddleFormersForCausalLM.supports(config("mistral"))
    assert not ok and "no implementation of MistralForCausalLM" in why
    windowed = dict(config(SERVED[0]), sliding_window=32, use_sliding_window=True)
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

    _, impl, why = pm.model_provider("Ernie4_5ForCausalLM", "paddleformers", config("ernie4_5"))
    assert impl == "paddleformers" and "Ernie4_5Model" in why
    with pytest.raises(UnsupportedArchitectureError) as info:
        pm.model_provider("MistralForCausalLM", "paddleformers", config("mistral"))
    message = str(info.value)
    assert "no implementation of MistralForCausalLM" in message and "LlamaForCausalLM" in message
    target, impl, _ = pm.model_provider("MistralForCausalLM", "auto", config("mistral"))
    assert impl == "fastdeploy" and target == "fd_llama.llama:LlamaForCausalLM"


@pytest.mark.slow
@pytest.mark.skipif(GENERATION_04, reason="PaddleFormers 0.4's Llama computes attention itself (refused)")
def test_default_model_through_both_implementations_gives_identical_greedy_tokens():
    """The embedded SmolLM2-135M-Instruct GGUF: 64 greedy tokens, native vs fallback."""
    from fastdeploy_core import LLM

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    results = {}
    for impl in ("fastdeploy", "paddleformers"):
        llm = LLM(model_impl=impl, max_model_len=512, num_gpu_blocks_override=16, max_num_seqs=4)
        assert (
            served_class(llm.engine.core)
            == {"fastdeploy": "LlamaForCausalLM", "paddleformers": "PaddleFormersForCausalLM"}[impl]
        )
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


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"] if GENERATION_04 else ["llama"])
def test_fallback_linears_take_the_quantization_method(ref, name):
    """wint8: PaddleFormers' linears (and the embedding) take int8 storage and compute like native wint8.

    Native and fallback wint8 agree to float rounding, far closer than either is to float32, and
    give the same greedy tokens (the MoE family's experts are the core MoE layer's int8 experts
    in both).
    """
    import numpy as np

    path, prompt = ref["paths"][name], ref["prompts"][1]
    native = make_core(path, model_impl="fastdeploy", quantization="wint8")
    fallback = make_core(path, model_impl="paddleformers", quantization="wint8")
    model = fallback.runner.model
    linears = {name: layer for name, layer in model.named_sublayers() if name.endswith("_proj")}
    if name.endswith("_moe"):  # q, k, v, o; the experts are the core MoE layer's
        assert len(linears) == 2 * 4 and "model.layers.1.self_attn.q_proj" in linears
    else:  # q, k, v, o and down, plus gate and up merged into PaddleFormers' fused up_gate_proj
        assert len(linears) == 2 * 6 and "model.layers.1.mlp.up_gate_proj" in linears
    assert all(type(layer.quant_method).__name__ == "WeightOnlyInt8" for layer in linears.values())
    assert all(str(layer.weight.dtype) == "paddle.int8" for layer in linears.values())
    quantized = first_step_logits(fallback, prompt)
    gap_to_native = np.abs(quantized - first_step_logits(native, prompt)).max()
    gap_to_float = np.abs(quantized - first_step_logits(make_core(path, model_impl="paddleformers"), prompt)).max()
    assert gap_to_native < 1e-4 * np.abs(quantized).max()
    assert gap_to_float > 100 * gap_to_native
    assert type(model.model.embed_tokens.quant_method).__name__ == "Int8EmbeddingMethod"
    moe = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert (
        all(str(experts.w13_weight.dtype) == "paddle.int8" for experts in moe) and len(moe) == (name == "qwen3_moe") * 2
    )
    for i, p in enumerate(ref["prompts"]):
        got_native = tokens(run(native, [("n", p)], ref["max_new"]), "n")
        assert tokens(run(fallback, [("f", p)], ref["max_new"]), "f") == got_native, f"prompt {i}"


@pytest.mark.skipif(GENERATION_04, reason="0.4's rotary functions take [b, T, h, d]: none is the form replaced")
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
@pytest.mark.skipif(GENERATION_04, reason="PaddleFormers 0.4's Llama computes attention itself (refused)")
def test_default_model_wint4_from_gguf_blocks_same_through_both_implementations():
    """GGUF Q4_1 blocks reach the fallback's wint4 linears (gate/up shards included) as for native Llama."""
    from fastdeploy_core import LLM

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for impl in ("fastdeploy", "paddleformers"):
        llm = LLM(model_impl=impl, quantization="wint4", max_model_len=256, num_gpu_blocks_override=8, max_num_seqs=2)
        model = llm.engine.core.runner.model
        methods = {
            type(layer.quant_method).__name__ for _, layer in model.named_sublayers() if hasattr(layer, "quant_method")
        }
        assert "WeightOnlyInt4" in methods
        results[impl] = list(llm.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids)
        del llm
    assert results["paddleformers"] == results["fastdeploy"]


@pytest.mark.parametrize("name", MOE)
def test_moe_families_run_on_the_core_moe_layer(ref, name):
    """PaddleFormers' expert lists (a Python loop per expert, or fused ops without CPU kernels) are gone."""
    from paddle import nn

    from fd_paddleformers.moe import GroupedMoe

    from fastdeploy_core.layers.moe import GroupedTopkRouter, SparseMoeBlock

    model = make_core(ref["paths"][name], model_impl="paddleformers").runner.model
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, (SparseMoeBlock, GroupedMoe))]
    assert blocks and all(block.experts.num_experts == 4 and block.top_k == 2 for block in blocks)
    assert not [n for n, layer in model.named_sublayers() if n.endswith("experts") and isinstance(layer, nn.LayerList)]
    if name == "ernie4_5_moe":  # shared experts kept (swapped to core linears), correction bias loaded
        assert all(block.shared_experts is not None and block.e_score_correction_bias is not None for block in blocks)
    if name == "deepseek_v3":  # the first layer dense; group-limited sigmoid routing with its loaded bias
        assert len(blocks) == 1 and blocks[0] is model.model.layers[1].mlp
        gate = blocks[0].gate
        assert isinstance(gate, GroupedTopkRouter) and (gate.num_groups, gate.topk_group) == (2, 1)
        assert gate.scoring == "sigmoid" and gate.routed_scaling_factor == 2.5 and gate.renormalize
        assert float(gate.e_score_correction_bias.abs().max()) > 0 and blocks[0].shared_experts is not None


@pytest.mark.parametrize("name", SERVED)
def test_every_layer_attends_through_the_paged_cache(ref, name):
    """Never PaddleFormers' eager/sdpa kernels: 0.4's eager attention applies no causal mask in
    ERNIE-4.5 and scales q twice in DeepSeek-V3 (both silently wrong, MEASURED.md)."""
    from fd_paddleformers.attention import ATTENTION_IMPLEMENTATION, BINDING_ATTRIBUTE

    core = make_core(ref["paths"][name], model_impl="paddleformers")
    model = core.runner.model
    assert model.pf_config._attn_implementation == ATTENTION_IMPLEMENTATION
    assert all(getattr(layer.self_attn, BINDING_ATTRIBUTE, None) is not None for layer in model.model.layers)
    run(core, [("a", ref["prompts"][1])], 2)
    assert model._step.attention_calls == model.num_layers  # the last step: one call per layer


@pytest.mark.skipif(not GENERATION_04, reason="the key placement PaddleFormers 0.4 reads")
def test_rope_theta_nested_in_rope_parameters_reaches_paddleformers_04(ref, monkeypatch):
    """transformers 5 writes rope_theta inside rope_parameters; 0.4 reads only the top level and
    would silently use 10000. The checkpoints use 1000: without the adapter's lift the logits move."""
    import numpy as np
    from fd_paddleformers.generations import Generation, PaddleFormers04

    path, prompt = ref["paths"]["qwen3"], ref["prompts"][ref["logits_prompt"]]
    with open(os.path.join(path, "config.json")) as f:
        assert "rope_theta" not in json.load(f)
    want = np.array(ref["logits"]["qwen3"])
    assert np.abs(first_step_logits(make_core(path, model_impl="paddleformers"), prompt) - want).max() < 1e-4
    monkeypatch.setattr(PaddleFormers04, "prepare_config", Generation.prepare_config)
    unlifted = first_step_logits(make_core(path, model_impl="paddleformers"), prompt)
    assert np.abs(unlifted - want).max() > 1e-2


@pytest.mark.skipif(not GENERATION_04, reason="the key PaddleFormers 0.4 reads")
def test_num_local_experts_reaches_paddleformers_04_as_num_experts(ref):
    """transformers 5 writes num_local_experts; 0.4 reads num_experts (default 60)."""
    model = make_core(ref["paths"]["qwen3_moe"], model_impl="paddleformers").runner.model
    assert model.pf_config.num_experts == 4


def test_generation_adapters_lay_attention_out_as_tokens_heads_dim():
    import numpy as np
    import paddle
    from fd_paddleformers.generations import PaddleFormers04, PaddleFormers1, generation_for

    assert isinstance(generation_for("0.4.0"), PaddleFormers04) and isinstance(generation_for("1.2.0"), PaddleFormers1)
    x = np.arange(5 * 3 * 4, dtype=np.float32).reshape(5, 3, 4)  # [T, h, d]
    bthd = paddle.to_tensor(x[None])
    bhtd = paddle.to_tensor(x.transpose(1, 0, 2)[None])
    for generation, tensor in ((PaddleFormers04(), bthd), (PaddleFormers1(), bhtd)):
        q, k, v = generation.attention_tokens(tensor, tensor, tensor)
        assert all(np.array_equal(t.numpy(), x) for t in (q, k, v))
    q, _, _ = PaddleFormers1().attention_tokens(bhtd[:, :, :1], bhtd[:, :, :1], bhtd[:, :, :1])  # one decode token
    assert np.array_equal(q.numpy(), x[:1])


def test_generation_04_reads_keys_where_transformers_5_writes_them():
    from fd_paddleformers.generations import PaddleFormers04

    values = PaddleFormers04().prepare_config(
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}, "num_local_experts": 8}
    )
    assert values["rope_theta"] == 1000.0 and values["num_experts"] == 8
    kept = PaddleFormers04().prepare_config({"rope_theta": 5.0, "rope_parameters": {"rope_theta": 1000.0}})
    assert kept["rope_theta"] == 5.0


@pytest.mark.skipif(not GENERATION_04, reason="Qwen3 is built by PaddleFormers 0.4 only")
def test_auto_picks_native_qwen3_and_plugins_command_says_why(ref):
    """An architecture both native code (fd-qwen) and the fallback serve: auto is native."""
    from typer.testing import CliRunner

    from fastdeploy_core.cli.main import app

    path = ref["paths"]["qwen3"]
    assert served_class(make_core(path)) == "Qwen3ForCausalLM"
    result = CliRunner().invoke(app, ["plugins", "--model", path, "--json"])
    assert result.exit_code == 0, result.output
    serving = json.loads(result.output)["model"]
    assert serving["impl"] == "fastdeploy" and serving["target"] == "fd_qwen.qwen:Qwen3ForCausalLM"
    assert serving["reason"] == "native implementation of Qwen3ForCausalLM"
    result = CliRunner().invoke(app, ["plugins", "--model", path, "--model-impl", "paddleformers"])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert "the paddleformers implementation" in first and "PaddleFormers Qwen3Model" in first


@pytest.mark.skipif(not GENERATION_04, reason="DeepSeek-V3 is built by PaddleFormers 0.4 only (1.x needs paddlefleet)")
def test_deepseek_v3_without_low_rank_query_gives_transformers_tokens(ref):
    """q_lora_rank null: q from one projection (PaddleFormers' unused q norm removed), 3 of 4
    experts from both groups, unnormalised weights."""
    import numpy as np

    name = "deepseek_v3_q_proj"
    core = make_core(ref["paths"][name], model_impl="paddleformers")
    assert "q_a_layernorm" not in dict(core.runner.model.model.layers[0].self_attn.named_children())
    logits = first_step_logits(core, ref["prompts"][ref["logits_prompt"]])
    assert np.abs(logits - np.array(ref["logits"][name])).max() < 1e-4
    outs = run(core, [(f"r{i}", p) for i, p in enumerate(ref["prompts"])], ref["max_new"])
    for i in range(len(ref["prompts"])):
        assert tokens(outs, f"r{i}") == ref["tokens"][name][i], f"prompt {i}"


@pytest.mark.skipif(not GENERATION_04, reason="DeepSeek-V3 is built by PaddleFormers 0.4 only (1.x needs paddlefleet)")
def test_deepseek_v3_attention_reshapes_by_each_steps_token_count(ref, monkeypatch):
    """0.4's DeepSeek attention reshapes its rotary key by ``self.seq_length`` (config.seq_length,
    fixed when built); the engine's steps each have their own length, so the fallback sets it per
    step. Its rotary also squeezes a one-token step's token axis away: replaced for fallback steps."""
    import numpy as np
    from fd_paddleformers import mla

    path, prompts = ref["paths"]["deepseek_v3"], ref["prompts"]
    core = make_core(path, model_impl="paddleformers")
    modules = core.runner.model._latent_attention
    assert len(modules) == core.runner.model.num_layers
    logits = first_step_logits(core, prompts[1])  # 23 tokens
    assert np.abs(logits - np.array(ref["logits"]["deepseek_v3"])).max() < 1e-4
    assert all(module.seq_length == 23 for module in modules)
    # prompt [1]: every step (prefill and decodes) has one token
    assert tokens(run(core, [("one", prompts[2])], 8), "one") == ref["tokens"]["deepseek_v3"][2][:8]
    assert all(module.seq_length == 1 for module in modules)

    monkeypatch.setattr(mla, "set_step_length", lambda modules, num_tokens: None)
    stale = make_core(path, model_impl="paddleformers")
    with pytest.raises(ValueError, match="reshape|Reshape"):
        first_step_logits(stale, prompts[1])


@pytest.mark.skipif(not GENERATION_04, reason="DeepSeek-V3 is built by PaddleFormers 0.4 only (1.x needs paddlefleet)")
def test_deepseek_v3_query_arrives_prescaled_and_is_not_scaled_twice(ref, monkeypatch):
    """PaddleFormers' MLA wrapper multiplies q by softmax_scale * sqrt(qk_head_dim) and also passes
    scaling=softmax_scale (0.4's eager kernel applies both: silently wrong). The paged kernel applies
    qk_head_dim**-0.5; honouring ``scaling`` instead moves the logits far from transformers'."""
    import numpy as np
    from fd_paddleformers import mla

    path, prompt = ref["paths"]["deepseek_v3"], ref["prompts"][ref["logits_prompt"]]
    want = np.array(ref["logits"]["deepseek_v3"])
    model = make_core(path, model_impl="paddleformers").runner.model
    attn = model.model.layers[0].self_attn
    assert attn.softmax_scale != attn.q_head_dim**-0.5  # YaRN's mscale_all_dim: the two scales differ
    assert model.kv_cache_spec() == (2, 4, 24)  # every head's K (16 + 8) and V padded from 16 to 24
    monkeypatch.setattr(mla, "kernel_scale", lambda module: module.softmax_scale)
    twice = first_step_logits(make_core(path, model_impl="paddleformers"), prompt)
    assert np.abs(twice - want).max() > 1e-2


@pytest.mark.skipif(not GENERATION_04, reason="DeepSeek-V3 is built by PaddleFormers 0.4 only (1.x needs paddlefleet)")
def test_deepseek_v3_checkpoints_paddleformers_would_compute_differently_are_refused(ref):
    from fd_paddleformers.model import PaddleFormersForCausalLM

    with open(os.path.join(ref["paths"]["deepseek_v3"], "config.json")) as f:
        config = json.load(f)
    ok, why = PaddleFormersForCausalLM.supports(dict(config, rope_interleave=False))
    assert not ok and "rope_interleave" in why
    ok, why = PaddleFormersForCausalLM.supports(
        dict(config, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    )
    assert not ok and "YaRN" in why
    with pytest.raises(UnsupportedArchitectureError, match="router"):
        PaddleFormersForCausalLM(dict(config, scoring_func="softmax"))


@pytest.mark.skipif(not GENERATION_04, reason="DeepSeek-V3 is built by PaddleFormers 0.4 only (1.x needs paddlefleet)")
def test_deepseek_v3_multi_token_prediction_tensors_are_skipped(ref):
    """DeepSeek-V3 checkpoints store their MTP layer as decoder layer num_hidden_layers: the fallback
    builds none and skips its tensors (past them, an unknown tensor is still an error)."""
    import numpy as np
    from safetensors.numpy import load_file

    from fastdeploy_core.errors import ModelLoadError

    from fd_paddleformers.model import PaddleFormersForCausalLM

    path = ref["paths"]["deepseek_v3"]
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["num_nextn_predict_layers"] == 1
    weights = load_file(os.path.join(path, "model.safetensors"))
    mtp = {k.replace("model.layers.1.", "model.layers.2."): v for k, v in weights.items() if "layers.1." in k}
    PaddleFormersForCausalLM(config).load_weights(list(weights.items()) + list(mtp.items()))
    stray = [("model.layers.3.input_layernorm.weight", np.ones(64, "float32"))]
    with pytest.raises(ModelLoadError, match="model.layers.3"):
        PaddleFormersForCausalLM(config).load_weights(list(weights.items()) + stray)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in ("ernie4_5", "qwen3", "ernie4_5_moe") if n in SERVED])
def test_fallback_under_tensor_parallelism_gives_transformers_tokens(ref, name):
    """Two rank processes: the fallback's Q/K/V, output, gate/up and down projections, its
    embedding and LM head split across the ranks as PaddleFormers' tp_plan says (each rank
    caches 1 of the 2 KV heads); experts stay whole on each rank, and so does PaddleFormers 1.x's
    ERNIE attention, whose Q/K/V is one fused projection (both ranks cache both KV heads)."""
    path, prompts, max_new = ref["paths"][name], ref["prompts"], ref["max_new"]
    core = make_core(path, model_impl="paddleformers", tensor_parallel_size=2)
    try:
        info = core.config_info()
        assert info["model_impl"] == "paddleformers"
        assert info["kv_cache_spec"]["token_shapes"][0][0] == (1 if GENERATION_04 else 2)  # the rank's KV heads
        outs = run(core, [(f"r{i}", p) for i, p in enumerate(prompts)], max_new)
        for i in range(len(prompts)):
            assert tokens(outs, f"r{i}") == ref["tokens"][name][i], f"prompt {i}"
    finally:
        core.runner.close()
