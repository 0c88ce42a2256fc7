"""Captured decode steps (csrc/graph.h, executor/decode_graph.py) against the eager forward.

A graph replays the kernels' computations on the buffers they had at capture: replayed steps
must give bit-identical hidden states and KV caches to eager steps over the same inputs, as
block tables grow and sequences move on; a capture that would miss work (an op that is not a
kernel, an undeclared input, an output not written by a kernel) must be refused, never replayed.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fastdeploy_core.config import EngineArgs
from fastdeploy_core.builtin.cpu.device import CpuDevice
from fastdeploy_core.devices.current import set_current_ops
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.errors import ConfigError
from fastdeploy_core.executor.decode_graph import DecodeGraphs
from fastdeploy_core.builtin.cpu.kernels import load_kernels
from fastdeploy_core.quantization.registry import resolve_quantization
from fastdeploy_core.testing.batches import build_meta

fd_llama = pytest.importorskip("fd_llama.llama")

BLOCK = 4
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def ops():
    if load_kernels() is None:
        pytest.skip("the cpu kernels cannot be built here")
    return CpuDevice.make_ops()


@pytest.fixture(autouse=True)
def _ops_installed(ops, restore_ops):
    set_current_ops(ops)


def _weights(seed: int = 0):
    rng = np.random.default_rng(seed)
    c = CONFIG
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d

    def w(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    out = [("model.embed_tokens.weight", w(c["vocab_size"], h)), ("model.norm.weight", 1 + w(h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", w(h, h)),
            (p + "self_attn.k_proj.weight", w(kv, h)),
            (p + "self_attn.v_proj.weight", w(kv, h)),
            (p + "self_attn.o_proj.weight", w(h, h)),
            (p + "mlp.gate_proj.weight", w(inter, h)),
            (p + "mlp.up_proj.weight", w(inter, h)),
            (p + "mlp.down_proj.weight", w(h, inter)),
            (p + "input_layernorm.weight", 1 + w(h)),
            (p + "post_attention_layernorm.weight", 1 + w(h)),
        ]
    return out


def _model(method: str | None):
    if method == "bfloat16":  # --dtype bfloat16's linear layers
        from fastdeploy_core.quantization.bfloat16 import BFloat16Linear

        quant = BFloat16Linear()
    else:
        quant = None if method is None else resolve_quantization(method, device=CpuDevice, hf_config=CONFIG)
    model = fd_llama.LlamaForCausalLM(dict(CONFIG), quant_config=quant)
    model.eval()
    model.load_weights(_weights())
    return model


def _caches(model, num_blocks: int = 24):
    layers, kvh, d = model.kv_cache_spec()
    return [(paddle.zeros([num_blocks, BLOCK, kvh, d]), paddle.zeros([num_blocks, BLOCK, kvh, d])) for _ in range(layers)]


def _host(meta):
    """The runner's ``host_only`` meta: numpy inputs."""
    for name in ("input_ids", "positions", "slot_mapping", "logits_indices"):
        setattr(meta, name, getattr(meta, name).numpy())
    return meta


@pytest.mark.parametrize("method", [None, "wint8", '{"quantization": "wint4", "group_size": 32}', "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_replayed_steps_equal_eager_steps_bitwise(ops, method, batch):
    model = _model(method)
    eager_caches, graph_caches = _caches(model), _caches(model)
    rng = np.random.default_rng(batch)
    prompts = [list(rng.integers(0, 96, size=3 + 2 * b)) for b in range(batch)]  # lengths 3, 5, 7
    tables = [[7 * b + 1 + i for i in range(7)] for b in range(batch)]  # scrambled, non-contiguous
    graphs = DecodeGraphs(model, ops, graph_caches, [batch], max_model_len=28, block_size=BLOCK)
    with paddle.no_grad():
        prefill = [(p, 0, t[: -(-len(p) // BLOCK)]) for p, t in zip(prompts, tables)]
        model(build_meta(prefill, BLOCK), eager_caches)
        model(build_meta(prefill, BLOCK), graph_caches)
        lengths = [len(p) for p in prompts]
        for step in range(7):  # crosses block boundaries: the tables grow between steps
            chunks = [
                ([int(rng.integers(0, 96))], n, t[: n // BLOCK + 1]) for n, t in zip(lengths, tables)
            ]
            eager = model(build_meta(chunks, BLOCK), eager_caches).numpy()
            replayed = graphs.run(_host(build_meta(chunks, BLOCK))).numpy()
            assert graphs.captured_sizes == [batch], graphs.disabled_reason
            # recorded on the first step, recorded again on the planned arena on the second
            assert graphs._graphs[batch, 1].captured.planned == (step >= 1)
            np.testing.assert_array_equal(replayed, eager, err_msg=f"step {step}")
            lengths = [n + 1 for n in lengths]
    # The activations share one arena (planned from a first recording): less than half of what
    # one buffer per op would take (~2100 floats per sequence for this model).
    arena = graphs._graphs[batch, 1].captured.arena_bytes
    assert 0 < arena < 0.5 * 2100 * 4 * batch
    for (ek, ev), (gk, gv) in zip(eager_caches, graph_caches):
        np.testing.assert_array_equal(gk.numpy(), ek.numpy())
        np.testing.assert_array_equal(gv.numpy(), ev.numpy())


def test_replay_reads_refreshed_inputs_and_kernel_bound_checks_still_fire(ops):
    weight = paddle.to_tensor(np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32))
    table = paddle.to_tensor(np.arange(40, dtype=np.float32).reshape(10, 4))
    ids_host = np.array([1, 2, 3], dtype=np.int64)
    ids = paddle.utils.dlpack.from_dlpack(ids_host)
    forward = lambda: ops.rms_norm(ops.embedding(ids, table), weight, 1e-6)  # noqa: E731
    plan = ops.capture_graph(forward, [table, weight, ids])
    assert plan.ok and not plan.planned, plan.reason
    with pytest.raises(Exception, match="holds only a memory plan"):
        plan.replay()
    graph = ops.capture_graph(forward, [table, weight, ids], previous=plan)
    plan.release()
    assert graph.ok and graph.planned, graph.reason
    first = graph.output.numpy().copy()
    ids_host[:] = [9, 0, 4]
    out = graph.replay().numpy()
    expected = ReferenceOps.rms_norm(ops, paddle.index_select(table, paddle.to_tensor(ids_host)), weight, 1e-6)
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-6)
    assert not np.array_equal(out, first)
    ids_host[1] = 10  # outside the table: the replayed kernel checks the data it reads
    with pytest.raises(Exception, match="outside the vocabulary of 10"):
        graph.replay()
    graph.release()
    with pytest.raises(RuntimeError, match="cannot be replayed"):
        graph.replay()


def test_capture_is_refused_when_a_paddle_op_feeds_a_kernel(ops):
    x = paddle.to_tensor(np.ones((2, 4), dtype=np.float32))
    weight = paddle.ones([4])
    graph = ops.capture_graph(lambda: ops.rms_norm(paddle.exp(x), weight, 1e-6), [x, weight])
    assert not graph.ok
    assert "fd_rms_norm read a tensor that is neither declared static" in graph.reason
    np.testing.assert_allclose(graph.output.numpy(), np.ones((2, 4)), rtol=1e-6)  # the step's result stands
    with pytest.raises(RuntimeError, match="cannot be replayed"):
        graph.replay()
    again = ops.capture_graph(lambda: ops.rms_norm(x, weight, 1e-6), [x, weight])  # the recorder was reset
    assert again.ok, again.reason
    again.release()


def test_capture_is_refused_for_an_undeclared_input_or_a_result_no_kernel_wrote(ops):
    x = paddle.to_tensor(np.ones((2, 4), dtype=np.float32))
    weight = paddle.ones([4])
    undeclared = ops.capture_graph(lambda: ops.rms_norm(x, weight, 1e-6), [x])
    assert not undeclared.ok and "neither declared static" in undeclared.reason
    not_written = ops.capture_graph(lambda: ops.rms_norm(x, weight, 1e-6) * 2, [x, weight])
    assert not not_written.ok and "was not written by an op of this library" in not_written.reason
    nothing = ops.capture_graph(lambda: x * 2, [x])
    assert not nothing.ok and "ran no op of this library" in nothing.reason


def test_an_error_inside_the_captured_forward_propagates_and_resets_the_recorder(ops):
    x = paddle.to_tensor(np.ones((2, 4), dtype=np.float32))
    weight = paddle.ones([4])

    def broken():
        ops.rms_norm(x, weight, 1e-6)
        raise ValueError("model bug")

    with pytest.raises(ValueError, match="model bug"):
        ops.capture_graph(broken, [x, weight])
    graph = ops.capture_graph(lambda: ops.rms_norm(x, weight, 1e-6), [x, weight])
    assert graph.ok, graph.reason
    graph.release()


def test_reference_ops_capture_nothing_and_return_the_output():
    ref = ReferenceOps()
    x = paddle.ones([2, 4])
    graph = ref.capture_graph(lambda: x + 1, [x])
    assert not graph.ok and "does not capture" in graph.reason
    np.testing.assert_array_equal(graph.output.numpy(), np.full((2, 4), 2, dtype=np.float32))


def test_a_refused_capture_turns_the_graphs_off_and_the_step_result_stands(ops):
    model = _model(None)
    caches = _caches(model)

    class PaddleOpOps(type(ops)):
        # the MLP's gate/up projection and SwiGLU as two ops, the SwiGLU a plain Paddle formula
        linear_silu_and_mul = ReferenceOps.linear_silu_and_mul

        def silu_and_mul(self, x):
            return ReferenceOps.silu_and_mul(self, x)

    mixed = PaddleOpOps()
    set_current_ops(mixed)
    graphs = DecodeGraphs(model, mixed, caches, [1], max_model_len=28, block_size=BLOCK)
    with paddle.no_grad():
        model(build_meta([([1, 2, 3], 0, [0])], BLOCK), caches)
        meta = build_meta([([4], 3, [0])], BLOCK)
        hidden = graphs.run(_host(build_meta([([4], 3, [0])], BLOCK))).numpy()
    assert graphs.disabled_reason and "fd_f32_linear read a tensor" in graphs.disabled_reason
    assert not graphs.accepts(1, True)
    assert graphs.captured_sizes == []
    other = _caches(model)
    with paddle.no_grad():
        model(build_meta([([1, 2, 3], 0, [0])], BLOCK), other)
        np.testing.assert_array_equal(hidden, model(meta, other).numpy())


def test_embedding_kernels_equal_the_reference(ops):
    rng = np.random.default_rng(3)
    table = paddle.to_tensor(rng.standard_normal((50, 40)).astype(np.float32))
    ids = paddle.to_tensor(np.array([0, 49, 7, 7, 23], dtype=np.int64))
    np.testing.assert_array_equal(ops.embedding(ids, table).numpy(), ReferenceOps.embedding(ops, ids, table).numpy())
    q = paddle.to_tensor(rng.integers(-127, 128, size=(50, 40)).astype(np.int8))
    for group in (40, 16):  # one scale per row; groups of 16 (the last one short)
        scale = paddle.to_tensor(rng.random((50, -(-40 // group))).astype(np.float32))
        got = ops.int8_embedding(ids, q, scale, group).numpy()
        np.testing.assert_array_equal(got, ReferenceOps.int8_embedding(ops, ids, q, scale, group).numpy())
    with pytest.raises(Exception, match="token id 50 outside the vocabulary of 50"):
        ops.embedding(paddle.to_tensor(np.array([50], dtype=np.int64)), table)


def test_graph_settings_take_fastdeploy_and_vllm_spellings():
    assert EngineArgs.create().graph_opt.enabled
    off = EngineArgs.create(graph_optimization_config='{"use_cudagraph": false}')
    assert not off.graph_opt.enabled
    assert not EngineArgs.create(enforce_eager=True).graph_opt.enabled
    sizes = EngineArgs.create(graph_optimization_config={"cudagraph_capture_sizes": [1, 2, 8]})
    assert sizes.graph_opt.cudagraph_capture_sizes == [1, 2, 8]
    with pytest.raises(ConfigError, match="graph_optimization_config: .* is not valid JSON"):
        EngineArgs.create(graph_optimization_config="{use_cudagraph}")
    with pytest.raises(ConfigError, match="0 is not a batch size"):
        EngineArgs.create(cudagraph_capture_sizes=[0, 4])
    with pytest.raises(ConfigError, match="graph_opt_level"):
        EngineArgs.create(graph_optimization_config='{"graph_opt_level": 2}')


def test_a_step_with_a_wider_block_table_than_max_model_len_needs_is_left_to_the_eager_path(ops):
    model = _model(None)
    graphs = DecodeGraphs(model, ops, _caches(model), [1], max_model_len=8, block_size=BLOCK)  # 2 blocks
    meta = _host(build_meta([([4], 3, [0, 1, 2])], BLOCK))
    with paddle.no_grad():
        assert graphs.run(meta) is None
    assert graphs.captured_sizes == [] and graphs.disabled_reason is None


@pytest.fixture
def checkpoint(tmp_path):
    """The tiny model as an HF directory (config.json + safetensors) an engine can load."""
    import json

    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    save_file(dict(_weights()), str(tmp_path / "model.safetensors"))
    return tmp_path


def test_the_engine_replays_decode_steps_of_every_batch_size_and_says_so(checkpoint):
    from fastdeploy_core.engine.engine_core import EngineCore
    from fastdeploy_core.engine.outputs import EngineCoreRequest
    from fastdeploy_core.engine.sampling_params import SamplingParams

    tmp_path = checkpoint
    outs = {}
    for eager in (False, True):
        core = EngineCore(
            EngineArgs.create(
                model=str(tmp_path), max_model_len=64, block_size=BLOCK, num_gpu_blocks_override=64,
                max_num_seqs=4, enforce_eager=eager,
            )
        )
        for i, prompt in enumerate([[1, 2, 3], [4, 5, 6, 7, 8], [9]]):
            sp = SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True)
            core.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=sp))
        tokens: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        outs[eager] = tokens
        runner = core.runner
        if eager:
            assert runner.graphs is None and runner.describe()["graph_capture"] == "off"
        else:
            assert runner.describe()["graph_capture"].startswith("decode batch sizes 1-4; steps of 2-9 tokens")
            assert runner.graphs.captured_sizes  # the batch shrinks 3 -> 2 -> 1 as requests finish
    assert outs[False] == outs[True] and len(outs[False]["2"]) == 12


def test_batch_sizes_share_the_static_inputs_and_interleave(ops):
    model = _model(None)
    eager_caches, graph_caches = _caches(model), _caches(model)
    graphs = DecodeGraphs(model, ops, graph_caches, [1, 2], max_model_len=28, block_size=BLOCK)
    tables = [[3, 9, 1, 12, 5, 7, 2], [8, 4, 11, 6, 10, 13, 14]]
    lengths = [5, 3]
    with paddle.no_grad():
        for caches in (eager_caches, graph_caches):
            model(build_meta([([7, 1, 9, 4, 2], 0, tables[0][:2]), ([6, 6, 3], 0, tables[1][:1])], BLOCK), caches)
        for step in range(9):
            active = [0, 1] if step % 3 else [0]  # sizes 2, 2, 1, 2, 2, 1, ...
            chunks = [([step + s], lengths[s], tables[s][: lengths[s] // BLOCK + 1]) for s in active]
            eager = model(build_meta(chunks, BLOCK), eager_caches).numpy()
            np.testing.assert_array_equal(graphs.run(_host(build_meta(chunks, BLOCK))).numpy(), eager)
            for s in active:
                lengths[s] += 1
    assert graphs.captured_sizes == [1, 2]
    for (ek, ev), (gk, gv) in zip(eager_caches, graph_caches):
        np.testing.assert_array_equal(gk.numpy(), ek.numpy())
        np.testing.assert_array_equal(gv.numpy(), ev.numpy())


def test_a_dropped_engine_frees_its_model_and_graphs(checkpoint):
    """Captured graphs hold the weights they read, and a layer's bound weight_loader on its own
    parameter made a cycle Python's collector cannot see through a Paddle tensor: either kept a
    dropped engine's model alive (SmolLM2: 108 MB to 630 MB per engine a process created)."""
    import gc
    import weakref

    from fastdeploy_core.engine.engine_core import EngineCore
    from fastdeploy_core.engine.outputs import EngineCoreRequest
    from fastdeploy_core.engine.sampling_params import SamplingParams

    core = EngineCore(
        EngineArgs.create(model=str(checkpoint), max_model_len=64, block_size=BLOCK, num_gpu_blocks_override=32)
    )
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    core.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=[1, 2, 3], sampling_params=sp))
    while core.has_unfinished_requests():
        core.step()
    assert core.runner.graphs.captured_sizes == [1]
    layers = [weakref.ref(layer) for layer in core.runner.model.sublayers(include_self=True)]
    layers = [ref for ref in layers if type(ref()).__name__ != "RotaryEmbedding"]  # shared by design (get_rope)
    handles = [graph.captured.state for graph in core.runner.graphs._graphs.values()]
    del core
    gc.collect()
    alive = sorted({type(ref()).__name__ for ref in layers if ref() is not None})
    assert alive == [], f"still alive after the engine was dropped: {alive}"
    # fd_graph_release answers 1 only for a graph still registered (holding the weights it read)
    from paddle import _C_ops

    assert [int(_C_ops._run_custom_op("fd_graph_release", h)[0].numpy()[0]) for h in handles] == [0]


def _offer(graphs, model, caches, chunks):
    """One step the way the runner takes it: the graphs when they accept its shape, else eager."""
    q = len(chunks[0][0])
    uniform = all(len(c[0]) == q for c in chunks)
    if graphs.accepts(len(chunks), q if uniform else None):
        out = graphs.run(_host(build_meta(chunks, BLOCK)))
        if out is not None:
            return out
    return model(build_meta(chunks, BLOCK), caches)


@pytest.mark.parametrize("method", [None, '{"quantization": "wint4", "group_size": 32}'])
@pytest.mark.parametrize("batch", [1, 3])
def test_verify_steps_of_q_tokens_replay_the_eager_logits_bitwise(ops, method, batch):
    """Steps of 1 + k tokens per sequence (a verify step's shape) are captured from their second
    occurrence and replayed: every row's hidden state and logits (all q positions of every
    sequence) and the KV caches equal the eager forward's bit for bit."""
    model = _model(method)
    eager_caches, graph_caches = _caches(model, 40), _caches(model, 40)
    rng = np.random.default_rng(10 + batch)
    q = 5
    tables = [[9 * b + 1 + i for i in range(9)] for b in range(batch)]
    lengths = [3 + 2 * b for b in range(batch)]
    graphs = DecodeGraphs(model, ops, graph_caches, range(1, 4), max_model_len=36, block_size=BLOCK)
    with paddle.no_grad():
        prefill = [(list(rng.integers(0, 96, size=n)), 0, t[: -(-n // BLOCK)]) for n, t in zip(lengths, tables)]
        for caches in (eager_caches, graph_caches):
            model(build_meta(prefill, BLOCK), caches)
        for step in range(5):  # eager (seen once), recorded, recorded on the arena, replayed twice
            chunks = [
                ([int(t) for t in rng.integers(0, 96, size=q)], n, t[: (n + q - 1) // BLOCK + 1])
                for n, t in zip(lengths, tables)
            ]
            eager = model(build_meta(chunks, BLOCK), eager_caches)
            got = _offer(graphs, model, graph_caches, chunks)
            np.testing.assert_array_equal(got.numpy(), eager.numpy(), err_msg=f"step {step}")
            np.testing.assert_array_equal(
                model.compute_logits(got).numpy(), model.compute_logits(eager).numpy(), err_msg=f"step {step}"
            )
            lengths = [n + q for n in lengths]
    assert graphs.disabled_reason is None and graphs.multi_token_disabled_reason is None
    assert graphs.captured_shapes == [(batch, q)]
    assert graphs.replays == {(batch, q): 2}  # fails if the capture silently never happens
    for (ek, ev), (gk, gv) in zip(eager_caches, graph_caches):
        np.testing.assert_array_equal(gk.numpy(), ek.numpy())
        np.testing.assert_array_equal(gv.numpy(), ev.numpy())


def test_at_most_max_multi_token_graphs_shapes_of_several_tokens_keep_graphs(ops, monkeypatch):
    from fastdeploy_core.executor import decode_graph

    assert decode_graph.MAX_MULTI_TOKEN_GRAPHS == 8 and decode_graph.MAX_QUERY_LEN == 9
    monkeypatch.setattr(decode_graph, "MAX_MULTI_TOKEN_GRAPHS", 3)  # fewer shapes than 8 to walk through
    model = _model(None)
    eager_caches, graph_caches = _caches(model, 40), _caches(model, 40)
    graphs = DecodeGraphs(model, ops, graph_caches, [1, 2], max_model_len=160, block_size=BLOCK)
    table = list(range(1, 40))
    length = 0
    seen: list[int] = []
    with paddle.no_grad():
        # lengths 2, 3, 4, 5 three times each (5 evicts (1, 2), the least recently used), then 2
        # again (evicting (1, 3); recorded at once, as it was seen before), then one token per step
        for q in [2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5, 2, 2, 2, 1, 1]:
            chunks = [([(length + i) % 96 for i in range(q)], length, table[: (length + q - 1) // BLOCK + 1])]
            eager = model(build_meta(chunks, BLOCK), eager_caches)
            np.testing.assert_array_equal(_offer(graphs, model, graph_caches, chunks).numpy(), eager.numpy())
            length += q
            seen.append(q)
            multi = [key for key in graphs._graphs if key[1] > 1]
            assert len(multi) <= 3, multi
            if len(seen) == 11:  # 5 seen twice: recorded, 2's graphs freed
                assert graphs.captured_shapes == [(1, 3), (1, 4), (1, 5)]
    assert graphs.captured_shapes == [(1, 1), (1, 2), (1, 4), (1, 5)]
    assert sorted(graphs._hosts) == [1, 2, 4, 5]  # the static arrays of q = 3 went with its graph
    # each length: seen once (eager), recorded, recorded on its arena; then replayed
    assert dict(graphs.replays) == {(1, 2): 1}
    assert not graphs.accepts(1, decode_graph.MAX_QUERY_LEN + 1) and not graphs.accepts(3, 2)  # too long; size 3 not listed
    assert not graphs.accepts(1, None)  # ragged


def test_a_refused_multi_token_capture_leaves_decode_steps_captured(ops):
    model = _model(None)
    caches = _caches(model)

    class RaggedOnPaddle(type(ops)):
        def rope_paged_attention(self, qkv, positions, cos_sin_cache, k_cache, v_cache, meta, *args, **kw):
            if meta.num_tokens > meta.num_seqs:  # the reference formula for steps of several tokens
                return ReferenceOps.rope_paged_attention(self, qkv, positions, cos_sin_cache, k_cache, v_cache, meta, *args, **kw)
            return super().rope_paged_attention(qkv, positions, cos_sin_cache, k_cache, v_cache, meta, *args, **kw)

    mixed = RaggedOnPaddle()
    set_current_ops(mixed)
    graphs = DecodeGraphs(model, mixed, caches, [1], max_model_len=28, block_size=BLOCK)
    with paddle.no_grad():
        model(build_meta([([1, 2, 3], 0, [0, 1, 2])], BLOCK), caches)
        for length in (3, 4, 5):
            _offer(graphs, model, caches, [([length], length, [0, 1, 2])])
        for length in (6, 8):  # seen once: eager; seen twice: recorded, refused
            _offer(graphs, model, caches, [([1, 2], length, [0, 1, 2])])
    assert graphs.multi_token_disabled_reason and "read a tensor" in graphs.multi_token_disabled_reason
    assert graphs.disabled_reason is None
    assert graphs.captured_shapes == [(1, 1)] and graphs.replays[(1, 1)] == 1
    assert not graphs.accepts(1, 2) and graphs.accepts(1, 1)


def test_the_runner_gives_replayed_verify_steps_the_eager_tokens_logprobs_and_hidden_states(checkpoint):
    """A verify step (1 + 3 tokens in each of 2 rows, hidden states asked for as the mtp proposer
    does, one row asking for logprobs) replayed from a captured graph gives the tokens, the
    logprobs of every position and the hidden states of every row of the eager runner's step."""
    from fastdeploy_core.executor.model_runner import ModelRunner
    from fastdeploy_core.executor.step_io import ScheduledRequest, SchedulerOutput
    from fastdeploy_core.spec_decode.draft_model import _Greedy

    class GreedyLogprobs(_Greedy):
        logprobs = 2

    def runner(eager: bool) -> ModelRunner:
        return ModelRunner(
            EngineArgs.create(
                model=str(checkpoint), max_model_len=64, block_size=BLOCK, num_gpu_blocks_override=40,
                enforce_eager=eager,
            )
        )

    def row(rid, tokens, prompt, computed, new, table, params, drafts=()):
        return ScheduledRequest(
            request_id=rid, all_token_ids=tokens, num_prompt_tokens=prompt, num_computed_tokens=computed,
            num_new_tokens=new, block_table=table, sampling_params=params, eos_token_ids=(), sample_seed=None,
            samples=True, draft_token_ids=list(drafts),
        )

    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in (5, 9)]
    tables = [[3, 11, 7, 19, 2, 30, 8, 25, 35, 37], [14, 1, 27, 9, 33, 6, 21, 16, 36, 38]]
    params = [_Greedy(), GreedyLogprobs()]
    runners = {eager: runner(eager) for eager in (True, False)}
    for eager, r in runners.items():
        r.execute_model(SchedulerOutput([row(str(i), p, len(p), 0, len(p), tables[i], params[i]) for i, p in enumerate(prompts)]))
    tokens = [p + [int(rng.integers(0, 96))] for p in prompts]  # each prompt and its first token
    for step in range(5):
        drafts = [[int(t) for t in rng.integers(0, 96, size=3)] for _ in tokens]
        rows = [
            row(str(i), t + d, len(prompts[i]), len(t) - 1, 4, tables[i], params[i], d)
            for i, (t, d) in enumerate(zip(tokens, drafts))
        ]
        outs = {eager: r.execute_model(SchedulerOutput(rows, return_hidden_states=True)) for eager, r in runners.items()}
        eager, graph = outs[True], outs[False]
        assert graph.spec_token_ids == eager.spec_token_ids and graph.spec_logprobs == eager.spec_logprobs
        assert eager.spec_logprobs[1] is not None and len(eager.spec_logprobs[1]) == len(eager.spec_token_ids[1])
        for g, e in zip(graph.hidden_states, eager.hidden_states):
            assert g.shape == [4, CONFIG["hidden_size"]]
            np.testing.assert_array_equal(g.numpy(), e.numpy(), err_msg=f"step {step}")
        tokens = [t + d + [int(rng.integers(0, 96))] for t, d in zip(tokens, drafts)]  # as if all were kept
    assert runners[False].graphs.replays[(2, 4)] == 2, dict(runners[False].graphs.replays)
    assert runners[True].graphs is None
