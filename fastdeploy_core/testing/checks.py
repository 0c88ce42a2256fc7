"""The conformance checks, as plain functions over a :class:`Target`.

Each check raises ``AssertionError`` (with what differed and by how much) or
:class:`CheckSkipped` (with why it cannot run here). The pytest plugin turns them into tests;
core tests call them directly.

The reference is always the cpu device's :class:`ReferenceOps` on the CPU place in float32.
The target is a device's ops table on the device's place (or on the CPU place when only its
fallback paths can run, ``--fd-place=cpu``), in every dtype the device declares that the place
can compute in.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field

import numpy as np
import paddle

from fastdeploy_core.devices.base import HOST_PLACE, Device, MemoryInfo
from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.testing.batches import BlockPool, blocks_for, build_meta

#: (atol, rtol) of an op's output against the float32 reference, per dtype of the target.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-4),
    "float16": (5e-3, 5e-3),
    "bfloat16": (3e-2, 3e-2),
}

#: Collective backends ``paddle.distributed`` accepts.
PADDLE_DIST_BACKENDS = ("gloo", "nccl", "bkcl", "xccl", "flagcx", "heter")

#: A tiny Llama: 2 layers, GQA 4:2, head_dim 16, vocabulary 128.
TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


class CheckSkipped(Exception):
    """A check that cannot run on this machine or for this device; the message says why."""


@dataclass
class Target:
    """What the kit checks: a device class, the ops class to run, where and in which dtypes."""

    device: type[Device]
    ops_class: type
    place: str  # paddle.set_device string: "cpu", "gpu:0", "iluvatar_gpu:0", ...
    dtypes: tuple[str, ...]
    on_device: bool  # False when a chip's ops run on the CPU place (its fallback paths)
    notes: list[str] = field(default_factory=list)

    def make_ops(self, attention_backend: str | None = None):
        backend = self.device.select_attention_backend(attention_backend) if attention_backend else None
        return self.ops_class(attention_backend=backend or self.device.attention_backends[0])

    @contextlib.contextmanager
    def placed(self):
        previous = paddle.device.get_device()
        paddle.device.set_device(self.place)
        try:
            yield
        finally:
            paddle.device.set_device(previous)


def make_target(device: type[Device], ops_class: type | None = None, place: str | None = None) -> Target:
    """A target for ``device``: its own ops on its own place, or ``ops_class``/``place`` overrides.

    On the CPU place only the dtypes Paddle's CPU kernels compute in (float32) are checked, on a
    device's own place every dtype it declares; a device computing in host memory (the cpu) declares
    bfloat16 for ``--dtype bfloat16``'s linear layers only (op ``bf16_linear``), so its ops are
    checked in float32.
    """
    ops_class = ops_class or device.ops_class or ReferenceOps
    if place is None or place == "device":
        avail = device.detect()
        if not avail.available:
            raise CheckSkipped(
                f"device {device.name!r} is not available here: {avail.reason} "
                "(use --fd-place=cpu to check its ops' CPU code paths)"
            )
        place = device.paddle_place(0)
    host_device = device.paddle_device_type == HOST_PLACE  # the device computes in host memory
    on_device = place.split(":")[0] == device.paddle_device_type and not host_device
    if on_device:
        dtypes = tuple(device.supported_dtypes)
    else:
        dtypes = tuple(d for d in device.supported_dtypes if d == "float32") or ("float32",)
    return Target(device, ops_class, place, dtypes, on_device or host_device)


# ---- helpers ----------------------------------------------------------------------------------
def _to(array: np.ndarray, dtype: str) -> paddle.Tensor:
    tensor = paddle.to_tensor(array)
    return tensor if dtype == "float32" else tensor.astype(dtype)


def _np(tensor: paddle.Tensor) -> np.ndarray:
    return tensor.astype("float32").cpu().numpy() if tensor.dtype != paddle.float32 else tensor.cpu().numpy()


def assert_close(actual: np.ndarray, expected: np.ndarray, dtype: str, what: str) -> None:
    atol, rtol = TOLERANCES.get(dtype, (3e-2, 3e-2))
    if actual.shape != expected.shape:
        raise AssertionError(f"{what} [{dtype}]: shape {actual.shape}, reference {expected.shape}")
    if not np.all(np.isfinite(actual)):
        raise AssertionError(f"{what} [{dtype}]: output has NaN/inf")
    err = np.abs(actual - expected)
    bound = atol + rtol * np.abs(expected)
    if np.any(err > bound):
        # Plain Python numbers: numpy 2 would print the reprs of its scalar types here.
        worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(err - bound)), err.shape))
        raise AssertionError(
            f"{what} [{dtype}]: max abs error {err.max():.3g} exceeds atol {atol} + rtol {rtol}; worst at {worst}: "
            f"{float(actual[worst]):.6g} vs reference {float(expected[worst]):.6g}"
        )


def cos_sin_cache(head_dim: int, max_positions: int, theta: float = 10000.0) -> np.ndarray:
    """The layout ``ReferenceOps.rotary_embedding`` documents: row 0 cos, row 1 ``[-sin, sin]``."""
    from fastdeploy_core.layers.rotary import build_cos_sin_cache

    return build_cos_sin_cache(head_dim, max_positions, theta, None)


# ---- declaration and detection ------------------------------------------------------------------
def check_declaration(target: Target) -> None:
    """The class attributes form a usable, self-consistent declaration."""
    dev = target.device
    assert dev.name and dev.name == dev.name.strip(), "Device.name must be a non-empty name"
    assert dev.paddle_device_type, f"{dev.name}: paddle_device_type is empty"
    assert dev.supported_dtypes, f"{dev.name}: supported_dtypes is empty"
    unknown = [d for d in dev.supported_dtypes if d not in TOLERANCES]
    assert not unknown, f"{dev.name}: unknown dtypes {unknown}; use Paddle names {sorted(TOLERANCES)}"
    assert dev.dist_backend in PADDLE_DIST_BACKENDS, (
        f"{dev.name}: dist_backend {dev.dist_backend!r} is not a paddle.distributed backend {PADDLE_DIST_BACKENDS}"
    )
    assert dev.attention_backends, f"{dev.name}: attention_backends is empty"
    assert issubclass(target.ops_class, ReferenceOps), (
        f"{target.ops_class.__qualname__} must derive from fastdeploy_core.devices.reference_ops.ReferenceOps"
    )
    for backend in dev.attention_backends:
        ops = target.ops_class(attention_backend=backend)
        assert ops.attention_backend == backend, f"{target.ops_class.__qualname__} ignored attention backend {backend!r}"
    assert isinstance(dev.quantization_methods, tuple), f"{dev.name}: quantization_methods must be a tuple"
    json.dumps(dev.describe())  # describe() must be JSON for `fastdeploy env --json`


def check_attention_backend_selection(target: Target) -> None:
    """The default is the first backend; an unknown name is a ConfigError listing the offered ones."""
    from fastdeploy_core.errors import ConfigError

    dev = target.device
    with _env_without("FD_ATTENTION_BACKEND"):
        assert dev.select_attention_backend(None) == dev.attention_backends[0]
        for backend in dev.attention_backends:
            assert dev.select_attention_backend(backend.upper()) == backend
        try:
            dev.select_attention_backend("no-such-backend")
        except ConfigError as exc:
            for backend in dev.attention_backends:
                assert backend in str(exc), f"error for an unknown backend does not list {backend!r}: {exc}"
        else:
            raise AssertionError(f"{dev.name}: an unknown attention backend was accepted")


@contextlib.contextmanager
def _env_without(name: str):
    import os

    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def check_detection(target: Target) -> None:
    """``detect()`` answers with a reason when unavailable; ``device_count()`` agrees with it."""
    avail = target.device.detect()
    count = target.device.device_count()
    if avail.available:
        assert count >= 1, f"{target.device.name}: available but device_count() is {count}"
    else:
        assert avail.reason.strip(), f"{target.device.name}: unavailable without a reason"
        assert count == 0, f"{target.device.name}: unavailable but device_count() is {count}"


def check_memory_info(target: Target) -> None:
    """Total > 0 and 0 <= free <= total, on the device itself."""
    if not target.device.detect().available:
        raise CheckSkipped(f"{target.device.name} is not available here, so its memory cannot be read")
    info = target.device.memory_info(0)
    assert isinstance(info, MemoryInfo), f"memory_info returned {type(info).__name__}, not MemoryInfo"
    assert info.total_bytes > 0, f"total_bytes is {info.total_bytes}"
    assert 0 <= info.free_bytes <= info.total_bytes, f"free {info.free_bytes} outside [0, total {info.total_bytes}]"


def check_expected_kernels(target: Target) -> None:
    """Every fused kernel the ops class expects is registered by Paddle for the device's place."""
    from fastdeploy_core.devices.kernels import has_kernel

    expected = getattr(target.ops_class, "expected_kernels", ())
    if not expected:
        raise CheckSkipped(f"{target.ops_class.__qualname__} declares no expected_kernels")
    if not target.on_device or target.device.paddle_device_type == HOST_PLACE:
        raise CheckSkipped(f"ops run on {target.place}, not on a {target.device.name}: kernels of the chip not checkable")
    with target.placed():
        missing = [
            (kernel, dtype)
            for kernel in expected
            for dtype in target.dtypes
            if dtype != "float32" and not has_kernel(kernel, paddle.zeros([1], dtype=dtype))
        ]
    assert not missing, f"Paddle registers no kernel for {missing} on {target.place}"


# ---- op-by-op parity ----------------------------------------------------------------------------
OPS = (
    "embedding",
    "linear",
    "rms_norm",
    "add_rms_norm",
    "silu_and_mul",
    "linear_silu_and_mul",
    "rotary_embedding",
    "write_kv_cache",
    "argmax_rows",
    "greedy_lm_head",
    "fused_moe",
    "bf16_linear",
)


def check_op(target: Target, op: str, dtype: str, seed: int = 0) -> None:
    """One op of the target against the reference on random inputs."""
    rng = np.random.default_rng(seed)
    ref = ReferenceOps()
    with target.placed():
        ops = target.make_ops()
        got, want = _run_op(op, ops, ref, rng, dtype)
    for i, (g, w) in enumerate(zip(got, want)):
        if np.issubdtype(w.dtype, np.integer):  # indices: exact
            if g.shape != w.shape or np.any(g != w):
                raise AssertionError(f"{op} output {i}: {g.tolist()}, reference {w.tolist()}")
        else:
            assert_close(g, w, dtype, f"{op} output {i}")


def _run_op(op, ops, ref, rng, dtype):
    f32 = np.float32
    T, H, V, I = 7, 32, 50, 24  # noqa: E741 - the usual names
    if op == "embedding":
        ids = rng.integers(0, V, size=T).astype(np.int64)
        w = rng.standard_normal((V, H)).astype(f32)
        with paddle.device.device_guard(HOST_PLACE):
            want = ref.embedding(paddle.to_tensor(ids), paddle.to_tensor(w))
        return [_np(ops.embedding(paddle.to_tensor(ids), _to(w, dtype)))], [want.numpy()]
    if op == "linear":
        x = rng.standard_normal((T, H)).astype(f32)
        w = (rng.standard_normal((H, I)) / np.sqrt(H)).astype(f32)
        b = rng.standard_normal(I).astype(f32)
        got = [_np(ops.linear(_to(x, dtype), _to(w, dtype))), _np(ops.linear(_to(x, dtype), _to(w, dtype), _to(b, dtype)))]
        want = [_cpu(ref.linear, x, w), _cpu(ref.linear, x, w, b)]
        # A layout the device prefers (prepare_linear_weight) must give the same products; I = 24
        # and 64 columns: a width some layouts cannot take and one they can.
        for cols in (I, 64):
            wide = (rng.standard_normal((H, cols)) / np.sqrt(H)).astype(f32)
            prepared = ops.prepare_linear_weight(_to(wide, dtype))
            if prepared is not None:
                got.append(_np(ops.linear(_to(x, dtype), prepared, _to(b[:1].repeat(cols), dtype))))
                want.append(_cpu(ref.linear, x, wide, b[:1].repeat(cols)))
        return got, want
    if op == "rms_norm":
        x = rng.standard_normal((T, H)).astype(f32)
        w = (1 + 0.1 * rng.standard_normal(H)).astype(f32)
        return [_np(ops.rms_norm(_to(x, dtype), _to(w, dtype), 1e-6))], [_cpu(ref.rms_norm, x, w, 1e-6)]
    if op == "add_rms_norm":
        x = rng.standard_normal((T, H)).astype(f32)
        r = rng.standard_normal((T, H)).astype(f32)
        w = (1 + 0.1 * rng.standard_normal(H)).astype(f32)
        n0, s0 = ops.add_rms_norm(_to(x, dtype), None, _to(w, dtype), 1e-6)
        n1, s1 = ops.add_rms_norm(_to(x, dtype), _to(r, dtype), _to(w, dtype), 1e-6)
        with paddle.device.device_guard(HOST_PLACE):
            rn0, rs0 = ref.add_rms_norm(paddle.to_tensor(x), None, paddle.to_tensor(w), 1e-6)
            rn1, rs1 = ref.add_rms_norm(paddle.to_tensor(x), paddle.to_tensor(r), paddle.to_tensor(w), 1e-6)
        return [_np(n0), _np(s0), _np(n1), _np(s1)], [rn0.numpy(), rs0.numpy(), rn1.numpy(), rs1.numpy()]
    if op == "silu_and_mul":
        x = rng.standard_normal((T, 2 * I)).astype(f32)
        return [_np(ops.silu_and_mul(_to(x, dtype)))], [_cpu(ref.silu_and_mul, x)]
    if op == "linear_silu_and_mul":
        # Plain [K, 2I] weights with and without a bias, and the table's prepared layout of 64
        # and 96 columns (halves of whole 32-column tiles, and not): fused or composed, the
        # table's answer is the SwiGLU of the product.
        x = rng.standard_normal((T, H)).astype(f32)
        got, want = [], []
        for cols, bias in ((2 * I, False), (2 * I, True), (64, False), (96, False)):
            w = (rng.standard_normal((H, cols)) / np.sqrt(H)).astype(f32)
            b = rng.standard_normal(cols).astype(f32) if bias else None
            want.append(_cpu(ref.linear_silu_and_mul, x, w, *([b] if bias else [])))
            if cols == 2 * I:
                got.append(_np(ops.linear_silu_and_mul(_to(x, dtype), _to(w, dtype), _to(b, dtype) if bias else None)))
                continue
            prepared = ops.prepare_linear_weight(_to(w, dtype))
            got.append(_np(ops.linear_silu_and_mul(_to(x, dtype), prepared if prepared is not None else _to(w, dtype))))
        return got, want
    if op == "rotary_embedding":
        d, heads, kv_heads, max_pos = 16, 4, 2, 64
        cache = cos_sin_cache(d, max_pos)
        pos = rng.integers(0, max_pos, size=T).astype(np.int64)
        q = rng.standard_normal((T, heads, d)).astype(f32)
        k = rng.standard_normal((T, kv_heads, d)).astype(f32)
        gq, gk = ops.rotary_embedding(paddle.to_tensor(pos), _to(q, dtype), _to(k, dtype), paddle.to_tensor(cache))
        gq_only, none_k = ops.rotary_embedding(paddle.to_tensor(pos), _to(q, dtype), None, paddle.to_tensor(cache))
        assert none_k is None, "rotary_embedding(k=None) must return None for k"
        with paddle.device.device_guard(HOST_PLACE):
            wq, wk = ref.rotary_embedding(paddle.to_tensor(pos), paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(cache))
        return [_np(gq), _np(gk), _np(gq_only)], [wq.numpy(), wk.numpy(), wq.numpy()]
    if op == "write_kv_cache":
        nb, bs, kvh, d = 6, 4, 2, 8
        slots = rng.permutation(nb * bs)[:T].astype(np.int64)
        k = rng.standard_normal((T, kvh, d)).astype(f32)
        v = rng.standard_normal((T, kvh, d)).astype(f32)
        kc, vc = paddle.zeros([nb, bs, kvh, d], dtype=dtype), paddle.zeros([nb, bs, kvh, d], dtype=dtype)
        ops.write_kv_cache(_to(k, dtype), _to(v, dtype), kc, vc, paddle.to_tensor(slots))
        want_k = np.zeros((nb * bs, kvh, d), f32)
        want_v = np.zeros((nb * bs, kvh, d), f32)
        want_k[slots], want_v[slots] = k, v
        return [_np(kc), _np(vc)], [want_k.reshape(nb, bs, kvh, d), want_v.reshape(nb, bs, kvh, d)]
    if op == "argmax_rows":
        # Greedy sampling: the first largest logit of each row; rows of 7, 50 and 1000 columns
        # (shorter than a vector, and not a multiple of one), one row and several, planted ties
        # (a later copy of the maximum must lose).
        got, want = [], []
        for rows, cols in ((1, 7), (T, V), (3, 1000)):
            x = rng.standard_normal((rows, cols)).astype(f32)
            top = x.argmax(axis=-1)
            for r in range(rows):
                later = rng.integers(top[r], cols)
                x[r, later] = x[r, top[r]]
                earlier = rng.integers(0, top[r] + 1)
                x[r, earlier] = x[r, top[r]]
            got.append(np.asarray(ops.argmax_rows(_to(x, "float32"))).astype(np.int64).reshape(-1))
            want.append(x.argmax(axis=-1).astype(np.int64))
        return got, want
    if op == "greedy_lm_head":
        # Greedy tokens from the LM head must be the table's own argmax_rows(linear(...)) for
        # the same batch, exactly: through the layout and state the table prepares and without
        # them. The head has an odd number of 32-column tiles; each row's best column has exact
        # copies (a later and an earlier one: the first must win) and near-copies whose logits
        # differ from it by float32 rounding only. Batches of 1, 3 and 9 rows.
        got, want = [], []
        cols = 32 * 7
        for rows in (1, 3, 9):
            x = rng.standard_normal((rows, H)).astype(f32)
            w = head_with_near_ties(rng, x, cols)
            hidden = _to(x, dtype)
            plain = _to(w, dtype)
            prepared = ops.prepare_linear_weight(plain)
            layouts = [(plain, None)]
            if prepared is not None:
                layouts.append((prepared, ops.prepare_greedy_head(prepared)))
            for weight, state in layouts:
                got.append(np.asarray(ops.greedy_lm_head(hidden, weight, None, state)).astype(np.int64).reshape(-1))
                want.append(np.asarray(ops.argmax_rows(ops.linear(hidden, weight))).astype(np.int64).reshape(-1))
        return got, want
    if op == "fused_moe":
        # 8 experts, top-2, over 1 token (decode) and 13 (a prompt): some experts get no token,
        # some several. Checked against the formula per token in float64 numpy, and the
        # reference table against the same formula.
        E, K = 8, 2  # noqa: N806 - the usual names
        w13 = (rng.standard_normal((E, H, 2 * I)) / np.sqrt(H)).astype(f32)
        w2 = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(f32)
        got, want = [], []
        for tokens in (1, 13):
            x = rng.standard_normal((tokens, H)).astype(f32)
            ids = np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]).astype(np.int64)
            weights = rng.uniform(0.1, 1.0, (tokens, K)).astype(f32)
            expected = np.zeros((tokens, H))
            for t in range(tokens):
                for j in range(K):
                    gate_up = x[t].astype(np.float64) @ w13[ids[t, j]]
                    gate, up = gate_up[:I], gate_up[I:]
                    expected[t] += weights[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ w2[ids[t, j]])
            args = (paddle.to_tensor(weights), paddle.to_tensor(ids))
            got.append(_np(ops.fused_moe(_to(x, dtype), _to(w13, dtype), _to(w2, dtype), *args)))
            want.append(expected.astype(f32))
            got.append(_cpu(ref.fused_moe, x, w13, w2, weights, ids))
            want.append(expected.astype(f32))
        return got, want
    if op == "bf16_linear":
        return _run_bf16_linear(ops, ref, rng)
    raise ValueError(f"unknown op {op!r}; known: {OPS}")


def _run_bf16_linear(ops, ref, rng):
    """``--dtype bfloat16``'s linear (float32 ``x``, bfloat16 weights, float32 out, whatever the
    target's dtype) against the reference formula, plain and in the layout the device prepares:
    64 columns (a width a packed layout takes), 24 (one it may not) and an odd ``in`` (33). A
    device that skipped rounding ``x`` to bfloat16 would be ~1e-3 off, above the float32 tolerance."""
    from fastdeploy_core.quantization.codes import bfloat16_bits

    got, want = [], []
    for rows, cols in ((32, 64), (32, 24), (33, 64)):
        x = rng.standard_normal((7, rows)).astype(np.float32)
        bits = bfloat16_bits(rng.standard_normal((rows, cols)) / np.sqrt(rows))
        b = rng.standard_normal(cols).astype(np.float32)
        weight = paddle.to_tensor(bits)
        prepared = ops.prepare_linear_weight(weight)
        for w in (weight, prepared) if prepared is not None else (weight,):
            got.append(_np(ops.bf16_linear(paddle.to_tensor(x), w, paddle.to_tensor(b))))
            with paddle.device.device_guard(HOST_PLACE):
                want.append(ref.bf16_linear(paddle.to_tensor(x), paddle.to_tensor(bits), paddle.to_tensor(b)).numpy())
    return got, want


def head_with_near_ties(rng, x: np.ndarray, cols: int, max_rows: int | None = None) -> np.ndarray:
    """A head ``[H, cols]`` in which each row of ``x`` (the first ``max_rows``) finds its best
    column copied exactly (once before, once after it) and three times moved by about one ulp
    per weight orthogonally to the row: those logits tie with the best in exact arithmetic and
    only float32 rounding (the summation order) decides between them."""
    hidden = x.shape[1]
    w = (rng.standard_normal((hidden, cols)) / np.sqrt(hidden)).astype(np.float32)
    taken: set[int] = set()
    for row in x[:max_rows].astype(np.float64):
        best = int(np.argmax(row @ w.astype(np.float64)))
        if best in taken:
            continue
        free = [c for c in rng.permutation(cols) if c not in taken and c != best]
        targets = [c for c in free if c < best][:1] + [c for c in free if c > best][:4]
        column = w[:, best].astype(np.float64)
        for i, target in enumerate(targets):
            copy = column
            if i >= 2:
                v = rng.standard_normal(hidden)
                v -= (v @ row) / (row @ row) * row
                copy = column + v * np.abs(column) * 2.0**-23
            w[:, target] = copy.astype(np.float32)
            taken.add(target)
        taken.add(best)
    return w


def _cpu(fn, *arrays):
    with paddle.device.device_guard(HOST_PLACE):
        args = [paddle.to_tensor(a) if isinstance(a, np.ndarray) else a for a in arrays]
        return fn(*args).numpy()


# ---- paged attention ----------------------------------------------------------------------------
#: name -> per sequence (new tokens this step, tokens already cached)
ATTENTION_SCENARIOS: dict[str, list[tuple[int, int]]] = {
    "prefill": [(9, 0), (3, 0), (16, 0)],
    "decode": [(1, 12), (1, 3), (1, 31)],
    "prefix_cached_chunked": [(5, 8), (1, 17), (8, 0), (3, 4)],
    "long_prefill_with_decodes": [(1, 14), (37, 6), (1, 2)],
    "sliding_window": [(1, 14), (9, 3), (20, 0), (1, 2)],
    # thousands of keys: a long decode (kernels may split its keys over threads), a prompt
    # chunk deep into its context, a short decode beside them
    "long_context": [(1, 3000), (150, 2000), (1, 40)],
    "long_sliding_window": [(1, 2600), (90, 1500)],
}
#: scenario -> ``sliding_window`` passed to the attention ops (Mistral v0.1 style)
ATTENTION_WINDOWS: dict[str, int] = {"sliding_window": 5, "long_sliding_window": 700}


def _attention_geometry(specs: list[tuple[int, int]], bs: int, min_blocks: int) -> tuple[int, int]:
    """(cache blocks, rotary positions) a scenario needs, at least ``min_blocks`` blocks."""
    blocks = sum(blocks_for(q + ctx, bs) for q, ctx in specs)
    return max(min_blocks, blocks + 4), max(q + ctx for q, ctx in specs)


def check_paged_attention(target: Target, scenario: str, backend: str, dtype: str, seed: int = 0) -> None:
    """Write this step's K/V then attend, for every sequence shape of ``scenario``, vs the reference."""
    rng = np.random.default_rng(seed)
    heads, kv_heads, d, bs = 4, 2, 16, 4
    specs = ATTENTION_SCENARIOS[scenario]
    nb, _ = _attention_geometry(specs, bs, 48)
    pool = BlockPool(nb, seed=seed)
    chunks = [(list(range(q)), ctx, pool.take(blocks_for(q + ctx, bs))) for q, ctx in specs]
    k_cache = rng.standard_normal((nb, bs, kv_heads, d)).astype(np.float32)  # stands in for earlier steps
    v_cache = rng.standard_normal((nb, bs, kv_heads, d)).astype(np.float32)
    total = sum(q for q, _ in specs)
    q = rng.standard_normal((total, heads, d)).astype(np.float32)
    k = rng.standard_normal((total, kv_heads, d)).astype(np.float32)
    v = rng.standard_normal((total, kv_heads, d)).astype(np.float32)
    scale = d**-0.5
    window = ATTENTION_WINDOWS.get(scenario)

    with paddle.device.device_guard(HOST_PLACE):
        ref = ReferenceOps()
        meta = build_meta(chunks, bs)
        rk, rv = paddle.to_tensor(k_cache), paddle.to_tensor(v_cache)
        ref.write_kv_cache(paddle.to_tensor(k), paddle.to_tensor(v), rk, rv, meta.slot_mapping)
        want = ref.paged_attention(paddle.to_tensor(q), rk, rv, meta, scale, window).numpy()

    with target.placed():
        ops = target.make_ops(backend)
        meta = build_meta(chunks, bs)
        tk, tv = _to(k_cache, dtype), _to(v_cache, dtype)
        ops.write_kv_cache(_to(k, dtype), _to(v, dtype), tk, tv, meta.slot_mapping)
        got = _np(ops.paged_attention(_to(q, dtype), tk, tv, meta, scale, window))
    assert_close(got, want, dtype, f"paged_attention[{backend}] {scenario}")


def check_rope_paged_attention(target: Target, scenario: str, backend: str, dtype: str, seed: int = 0) -> None:
    """The fused attention block (rotary, KV write, attention from a QKV projection) vs the
    reference's three ops: the output and both caches afterwards."""
    rng = np.random.default_rng(seed + 1)
    heads, kv_heads, d, bs = 6, 2, 16, 4
    specs = ATTENTION_SCENARIOS[scenario]
    nb, positions = _attention_geometry(specs, bs, 64)
    pool = BlockPool(nb, seed=seed)
    chunks = [(list(range(q)), ctx, pool.take(blocks_for(q + ctx, bs))) for q, ctx in specs]
    k_cache = rng.standard_normal((nb, bs, kv_heads, d)).astype(np.float32)
    v_cache = rng.standard_normal((nb, bs, kv_heads, d)).astype(np.float32)
    total = sum(q for q, _ in specs)
    qkv = rng.standard_normal((total, (heads + 2 * kv_heads) * d)).astype(np.float32)
    table = cos_sin_cache(d, max(128, positions)).astype(np.float32)
    scale = d**-0.5
    args = (heads, kv_heads, scale, ATTENTION_WINDOWS.get(scenario))

    with paddle.device.device_guard(HOST_PLACE):
        meta = build_meta(chunks, bs)
        rk, rv = paddle.to_tensor(k_cache), paddle.to_tensor(v_cache)
        want = ReferenceOps().rope_paged_attention(
            paddle.to_tensor(qkv), meta.positions, paddle.to_tensor(table), rk, rv, meta, *args
        )
        want, want_k, want_v = want.numpy(), rk.numpy(), rv.numpy()

    with target.placed():
        ops = target.make_ops(backend)
        meta = build_meta(chunks, bs)
        tk, tv = _to(k_cache, dtype), _to(v_cache, dtype)
        got = _np(ops.rope_paged_attention(_to(qkv, dtype), meta.positions, _to(table, dtype), tk, tv, meta, *args))
        got_k, got_v = _np(tk), _np(tv)
    assert got.shape == (total, heads * d), f"rope_paged_attention returned {got.shape}, expected {(total, heads * d)}"
    assert_close(got, want, dtype, f"rope_paged_attention[{backend}] {scenario}")
    assert_close(got_k, want_k, dtype, f"rope_paged_attention[{backend}] {scenario}: k_cache")
    assert_close(got_v, want_v, dtype, f"rope_paged_attention[{backend}] {scenario}: v_cache")


#: Relative distance two roundings of one float32 value to bfloat16 may have (one bfloat16 step:
#: 7 stored mantissa bits; a key rotated with or without a fused multiply-add can round apart).
BF16_STEP = 2.0**-7


#: Attention over a bfloat16 cache rounds its softmax weights to bfloat16 before they multiply the
#: values (``ReferenceOps.paged_attention``: bf16(exp(s - M)), M on the multiples of ln 2). A
#: kernel computes exp and the scores with other float32 roundings, which can tip a weight's
#: rounding the other way (rarely), or may round weights relative to another maximum altogether:
#: two roundings of one weight differ by at most 2^-8 of it (2^-9 each), so an output may differ
#: from the reference's by up to 2^-8 * sum_j p_j |v_j| beyond the float32 tolerance.
BF16_WEIGHT_ROUNDING = 2.0**-8


def assert_within_weight_rounding(got: np.ndarray, want: np.ndarray, weighted_abs: np.ndarray, what: str) -> None:
    """``got`` within the float32 tolerance plus :data:`BF16_WEIGHT_ROUNDING` of ``weighted_abs``
    (the reference attention over ``|v|``: sum_j p_j |v_j| per output element) of ``want``."""
    atol, rtol = TOLERANCES["float32"]
    bound = atol + rtol * np.abs(want) + BF16_WEIGHT_ROUNDING * weighted_abs
    excess = np.abs(got - want) / bound
    if not np.all(excess <= 1.0):
        worst = np.unravel_index(int(np.nanargmax(excess)), excess.shape)
        raise AssertionError(
            f"{what}: {int(np.sum(~(excess <= 1.0)))} of {excess.size} elements beyond the bfloat16 attention bound; "
            f"worst at {worst}: got {got[worst]!r}, want {want[worst]!r}, bound {bound[worst]!r}"
        )


def _widened(cache: paddle.Tensor) -> np.ndarray:
    return cache.astype("float32").cpu().numpy()


def check_bf16_kv_cache(target: Target, scenario: str, backend: str, seed: int = 0) -> None:
    """``--kv-cache-dtype bfloat16``: the attention block (rotary, KV write, attention) over
    bfloat16 K/V caches with float32 activations, for every sequence shape of ``scenario``.

    The caches the target writes must hold the reference's bfloat16 roundings (round to
    nearest, ties to even) of the new keys and values, each within one bfloat16 step of the
    reference's (a rotated key computed with another float32 rounding may round to the
    neighbouring bfloat16), every other entry untouched, and stay bfloat16. The output must be
    the reference attention over the caches the target wrote (bfloat16 multiplies: rounded
    queries and softmax weights, float32 sums) within the float32 tolerance plus the weights'
    rounding (:func:`assert_within_weight_rounding`): the kernel reads the bfloat16 values it
    stored, no others.
    """
    rng = np.random.default_rng(seed + 2)
    heads, kv_heads, d, bs = 6, 2, 16, 4
    specs = ATTENTION_SCENARIOS[scenario]
    nb, positions = _attention_geometry(specs, bs, 64)
    pool = BlockPool(nb, seed=seed)
    chunks = [(list(range(q)), ctx, pool.take(blocks_for(q + ctx, bs))) for q, ctx in specs]
    k_cache = rng.standard_normal((nb, bs, kv_heads, d)).astype(np.float32)  # rounded when made bfloat16
    v_cache = rng.standard_normal((nb, bs, kv_heads, d)).astype(np.float32)
    total = sum(q for q, _ in specs)
    qkv = rng.standard_normal((total, (heads + 2 * kv_heads) * d)).astype(np.float32)
    table = cos_sin_cache(d, max(128, positions)).astype(np.float32)
    scale = d**-0.5
    window = ATTENTION_WINDOWS.get(scenario)

    with paddle.device.device_guard(HOST_PLACE):
        ref = ReferenceOps()
        meta = build_meta(chunks, bs)
        rk, rv = _to(k_cache, "bfloat16"), _to(v_cache, "bfloat16")
        ref.rope_paged_attention(paddle.to_tensor(qkv), meta.positions, paddle.to_tensor(table), rk, rv, meta,
                                 heads, kv_heads, scale, window)
        want_k, want_v = _widened(rk), _widened(rv)

    with target.placed():
        ops = target.make_ops(backend)
        meta = build_meta(chunks, bs)
        tk, tv = _to(k_cache, "bfloat16"), _to(v_cache, "bfloat16")
        got = _np(ops.rope_paged_attention(paddle.to_tensor(qkv), meta.positions, paddle.to_tensor(table), tk, tv,
                                           meta, heads, kv_heads, scale, window))
        if tk.dtype != paddle.bfloat16 or tv.dtype != paddle.bfloat16:
            raise AssertionError(f"bf16 KV cache {scenario}: the caches became {tk.dtype}/{tv.dtype}")
        got_k, got_v = _widened(tk), _widened(tv)
    for name, g, w in (("k_cache", got_k, want_k), ("v_cache", got_v, want_v)):
        np.testing.assert_allclose(g, w, rtol=BF16_STEP, atol=0,
                                   err_msg=f"rope_paged_attention[{backend}] bf16 KV cache {scenario}: {name}")

    with paddle.device.device_guard(HOST_PLACE):  # the reference over the caches the target wrote
        ref_meta = build_meta(chunks, bs)
        qk = paddle.to_tensor(qkv).reshape([total, heads + 2 * kv_heads, d])[:, : heads + kv_heads]
        rotated, _ = ref.rotary_embedding(ref_meta.positions, qk, None, paddle.to_tensor(table))
        q = rotated[:, :heads]
        want = ref.paged_attention(q, _to(got_k, "bfloat16"), _to(got_v, "bfloat16"), ref_meta, scale, window)
        want = want.reshape([total, heads * d]).numpy()
        weighted_abs = ref.paged_attention(q, _to(got_k, "bfloat16"), _to(np.abs(got_v), "bfloat16"), ref_meta,
                                           scale, window)
        weighted_abs = weighted_abs.reshape([total, heads * d]).numpy()
    assert_within_weight_rounding(got, want, weighted_abs, f"rope_paged_attention[{backend}] bf16 KV cache {scenario}")


def check_mla_paged_attention(target: Target, scenario: str, backend: str, dtype: str, seed: int = 0) -> None:
    """Multi-head latent attention: the target's latent-cache write and its ``auto``, ``absorbed``
    and ``expanded`` forms against the reference's expanded form, for every sequence shape of
    ``scenario`` (the window, if any, does not apply: latent attention has none). Also holds the
    reference to its own contract: its absorbed form equals its expanded form within 1e-5."""
    rng = np.random.default_rng(seed + 2)
    heads, rank, nope, rope, v_dim, bs = 4, 24, 16, 8, 12, 4
    specs = ATTENTION_SCENARIOS[scenario]
    nb, _ = _attention_geometry(specs, bs, 64)
    pool = BlockPool(nb, seed=seed)
    chunks = [(list(range(q)), ctx, pool.take(blocks_for(q + ctx, bs))) for q, ctx in specs]
    cache = rng.standard_normal((nb, bs, 1, rank + rope)).astype(np.float32)  # stands in for earlier steps
    total = sum(q for q, _ in specs)
    q = rng.standard_normal((total, heads, nope + rope)).astype(np.float32)
    latent = rng.standard_normal((total, rank + rope)).astype(np.float32)
    w_kv = (rng.standard_normal((heads, rank, nope + v_dim)) / np.sqrt(rank)).astype(np.float32)
    scale = (nope + rope) ** -0.5

    want = {}
    with paddle.device.device_guard(HOST_PLACE):
        ref = ReferenceOps()
        for form in ("expanded", "absorbed"):
            meta = build_meta(chunks, bs)
            rc = paddle.to_tensor(cache)
            args = (paddle.to_tensor(q), paddle.to_tensor(latent), rc, meta, paddle.to_tensor(w_kv), scale, form)
            want[form] = ref.mla_paged_attention(*args).numpy()
        want_cache = rc.numpy()
    np.testing.assert_allclose(
        want["absorbed"], want["expanded"], atol=1e-5, rtol=0, err_msg=f"reference absorbed vs expanded, {scenario}"
    )

    with target.placed():
        ops = target.make_ops(backend)
        for form in ("auto", "absorbed", "expanded"):
            meta = build_meta(chunks, bs)
            tc = _to(cache, dtype)
            got = _np(
                ops.mla_paged_attention(_to(q, dtype), _to(latent, dtype), tc, meta, _to(w_kv, dtype), scale, form)
            )
            assert got.shape == (total, heads * v_dim), f"mla_paged_attention returned {got.shape}"
            assert_close(got, want["expanded"], dtype, f"mla_paged_attention[{backend}] {form} {scenario}")
            assert_close(_np(tc), want_cache, dtype, f"mla_paged_attention[{backend}] {form} {scenario}: latent cache")


# ---- end to end ---------------------------------------------------------------------------------
def tiny_llama(seed: int = 0, dtype: str = "float32"):
    """fd_llama's LlamaForCausalLM on :data:`TINY_LLAMA_CONFIG` with seeded random weights."""
    try:
        from fd_llama.llama import LlamaForCausalLM
    except ImportError as exc:
        raise CheckSkipped(f"fd-llama is not installed ({exc}); the end-to-end check needs it") from None
    from fastdeploy_core.layers import rotary

    rng = np.random.default_rng(seed)
    # Layers share one rotary cache per setting process-wide; the kit builds the reference and the
    # target model on different places, so each build gets its own cache on its own place.
    shared, rotary._SHARED_CACHES = rotary._SHARED_CACHES, {}
    try:
        model = LlamaForCausalLM(dict(TINY_LLAMA_CONFIG))
    finally:
        rotary._SHARED_CACHES = shared
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        shape = tuple(param.shape)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            fan_in = shape[0] if len(shape) == 2 else 1
            value = rng.standard_normal(shape) / np.sqrt(max(fan_in, 1)) * (2.0 if "embed" in name else 1.0)
        param.set_value(value.astype(np.float32))
    model.eval()
    if dtype != "float32":
        model.to(dtype=dtype)
    return model


def greedy_generate(model, ops, prompts: list[list[int]], max_new_tokens: int, dtype: str, prefill_chunk: int | None):
    """Greedy decoding of ``prompts`` in one ragged batch through paged caches; ``(tokens, logits per step)``."""
    from fastdeploy_core.devices.current import current_ops, set_current_ops

    num_layers, kv_heads, head_dim = model.kv_cache_spec()
    bs = 4
    need = [blocks_for(len(p) + max_new_tokens, bs) for p in prompts]
    pool = BlockPool(sum(need) + 1, seed=1)
    tables = [pool.take(n) for n in need]
    caches = [
        (paddle.zeros([pool.num_blocks, bs, kv_heads, head_dim], dtype=dtype),
         paddle.zeros([pool.num_blocks, bs, kv_heads, head_dim], dtype=dtype))
        for _ in range(num_layers)
    ]
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    generated: list[list[int]] = [[] for _ in prompts]
    logits_seen: list[list[np.ndarray]] = [[] for _ in prompts]
    previous = current_ops()
    set_current_ops(ops)
    try:
        while any(len(g) < max_new_tokens for g in generated):
            chunks, active = [], []
            for i in range(len(prompts)):
                if len(generated[i]) >= max_new_tokens:
                    continue
                remaining = len(tokens[i]) - computed[i]
                take = remaining if prefill_chunk is None else min(remaining, prefill_chunk)
                chunks.append((tokens[i][computed[i] : computed[i] + take], computed[i], tables[i]))
                active.append((i, take))
            meta = build_meta(chunks, bs)
            with paddle.no_grad():
                hidden = model(meta, caches)
                logits = _np(model.compute_logits(paddle.index_select(hidden, meta.logits_indices, axis=0)))
            for row, (i, take) in enumerate(active):
                computed[i] += take
                if computed[i] == len(tokens[i]):
                    token = int(np.argmax(logits[row]))
                    generated[i].append(token)
                    tokens[i].append(token)
                    logits_seen[i].append(logits[row])
    finally:
        set_current_ops(previous)
    return generated, logits_seen


E2E_PROMPTS = [[1, 17, 33, 5, 90, 12, 7], [1, 64, 3], [1, 9, 9, 41, 100, 2, 77, 56, 23, 11, 8]]


def check_generation(target: Target, max_new_tokens: int = 8) -> None:
    """Greedy tokens of a tiny random Llama, chunked prefill mixed with decode, equal the cpu reference.

    In float32 the tokens must match exactly. A device without float32 runs in its first dtype;
    there a token may differ only where the reference's top-2 logits are within that dtype's
    tolerance (a near-tie), and the comparison stops at the first such divergence.
    """
    with paddle.device.device_guard(HOST_PLACE):
        ref_model = tiny_llama()
        want, want_logits = greedy_generate(ref_model, ReferenceOps(), E2E_PROMPTS, max_new_tokens, "float32", 4)
    dtype = "float32" if "float32" in target.dtypes else target.dtypes[0]
    for backend in target.device.attention_backends:
        with target.placed():
            model = tiny_llama(dtype=dtype)
            got, _ = greedy_generate(model, target.make_ops(backend), E2E_PROMPTS, max_new_tokens, dtype, 4)
        for i, (g, w) in enumerate(zip(got, want)):
            if g == w:
                continue
            if dtype == "float32":
                raise AssertionError(f"[{backend}] prompt {i}: generated {g}, cpu reference {w}")
            first = next(j for j, (a, b) in enumerate(zip(g, w)) if a != b)
            top2 = np.sort(want_logits[i][first])[-2:]
            atol, _ = TOLERANCES[dtype]
            if top2[1] - top2[0] > 4 * atol:
                raise AssertionError(
                    f"[{backend}/{dtype}] prompt {i}: token {first} is {g[first]}, reference {w[first]} "
                    f"with a top-2 logit gap {top2[1] - top2[0]:.3g} (not a near-tie)"
                )


# ---- quantization -------------------------------------------------------------------------------
def check_quantization_method(target: Target, method: str) -> None:
    """A declared quantization method is registered, loads float weights and runs on the device's ops (see quantization.conformance)."""
    from fastdeploy_core.plugins import get_plugin_manager

    registry = get_plugin_manager().quantizers
    if len(registry) == 0:
        raise CheckSkipped(
            f"the quantization registry is empty in this build, so {method!r} cannot be loaded or run yet"
        )
    if method not in registry:
        raise CheckSkipped(
            f"quantization method {method!r} is declared by {target.device.name} but no installed plugin registers it "
            f"(registered: {', '.join(sorted(registry.keys()))})"
        )
    from fastdeploy_core.quantization.conformance import check_method

    with target.placed():
        check_method(target.make_ops(), method)
