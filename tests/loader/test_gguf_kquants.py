"""GGUF files with Q4_K and Q6_K tensors load to the weights they hold (issue #3).

gguf-py can dequantize K-quants but not quantize to them, so this file carries its own small
K-quant quantizer that writes the GGML block layouts byte by byte, and its own decoder written
from ggml's reference ``dequantize_row_q4_K`` / ``dequantize_row_q6_K`` (loops over the block's
byte positions, not gguf-py's reshapes). The tests check:

* the blocks gguf-py decodes are exactly the values our decoder reads from the layout (for
  random bytes, which reach every bit pattern of the packed scales, and for quantized weights);
* quantize -> dequantize stays within half a quantization step of each sub-block, the step
  being bounded by the sub-block's own range (see ``_q4_k_error_bound`` / ``_q6_k_error_bound``);
* a tiny Llama GGUF written like llama.cpp does (Q/K row permutation, raw K-quant blocks) loads
  through ``resolve_model_source`` / ``iterate_gguf`` to exactly those values, and the engine's
  first-step logits and 16 greedy tokens equal transformers' on the same dequantized weights.

Layouts (QK_K = 256 values per super-block, blocks run along a row):

* Q4_K, 144 bytes: f16 ``d``, f16 ``dmin``, 12 bytes of 6-bit scale/min codes for 8 sub-blocks
  of 32, 128 bytes of 4-bit codes; ``w = d * sc[j] * q - dmin * m[j]``. Scale codes: bytes 0-3
  hold sc[0..3] in bits 0-5 and the top 2 bits of sc[4..7] in bits 6-7; bytes 4-7 the same for
  the mins; bytes 8-11 hold the low nibbles of sc[4..7] (bits 0-3) and m[4..7] (bits 4-7). Each
  64 values share 32 bytes of codes: the first 32 values in the low nibbles, the next 32 high.
* Q6_K, 210 bytes: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales (one per 16
  values), f16 ``d``; ``w = d * scale[j] * (q - 32)``. Per half of 128 values, ``ql[l]`` holds
  values l (low nibble) and l+64 (high), ``ql[l+32]`` values l+32 and l+96, and ``qh[l]`` the top
  2 bits of values l, l+32, l+64, l+96 in bits 0-1, 2-3, 4-5, 6-7.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import gguf
import numpy as np
import pytest
import torch
from fd_llama.llama import LlamaForCausalLM
from gguf import GGMLQuantizationType
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from fastdeploy_core.loader import iterate_gguf, load_model_weights, resolve_model_source
from fastdeploy_core.testing.paged_harness import PagedHarness
from tests.support.reference import hf_greedy
from tests.loader.test_gguf_and_bad_inputs import write_llama_gguf

QK_K = 256
Q4_K_BYTES, Q6_K_BYTES = 144, 210
F32_EPS = float(np.finfo(np.float32).eps)
F16_SLACK = 1 + 2.0**-9  # rounding a positive float up to float16 costs less than one part in 2**10

# hidden and intermediate sizes are multiples of 256 (a K-quant super-block runs along a row);
# 8 query heads of 32 over 2 KV heads, so llama.cpp's Q/K row permutation has something to do.
TINY = {
    "vocab_size": 97,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.08,
    "tie_word_embeddings": False,
}
PROMPT = [1, 9, 33, 4, 58, 20, 7, 90, 61]
NEW_TOKENS = 16


# ---- quantizer: float32 rows -> K-quant block bytes -----------------------------------------


def _f16_at_least(value: np.ndarray) -> np.ndarray:
    """``value`` (>= 0) as float16, rounded up so that the stored scale never falls short."""
    half = np.asarray(value, dtype=np.float32).astype(np.float16)
    short = half.astype(np.float32) < value
    return np.where(short, np.nextafter(half, np.float16(np.inf)), half).astype(np.float16)


def _ceil_codes(value: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """``ceil(value / unit)`` clipped to ``0..top`` (0 where the unit is 0); a ratio that float32
    rounding puts a hair above an integer (63.000004) is taken as that integer."""
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(unit > 0, np.ceil(value / unit * np.float32(1 - 2.0**-20)), 0.0)
    return np.clip(codes, 0, top).astype(np.uint8)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """float32 ``[rows, n]`` (n % 256 == 0) -> uint8 ``[rows, n / 256 * 144]`` Q4_K blocks.

    Per sub-block of 32: the grid ``d_j * q - m_j`` (q = 0..15) is made to cover the values,
    with ``m_j = dmin * ceil(-min / dmin)`` (min clamped to <= 0, since the offset is subtracted)
    and ``d_j = d * ceil((max + m_j) / (15 d))``; each value takes its nearest code.
    """
    rows, n = weight.shape
    x = np.asarray(weight, dtype=np.float32).reshape(-1, 8, 32)
    nb = x.shape[0]
    lo = np.minimum(x.min(axis=-1), 0.0)  # [nb, 8]
    hi = x.max(axis=-1)
    dmin = _f16_at_least((-lo).max(axis=-1) / 63)  # [nb]
    mins = _ceil_codes(-lo, dmin.astype(np.float32)[:, None], 63)
    offset = dmin.astype(np.float32)[:, None] * mins.astype(np.float32)  # what the decoder subtracts
    span = (hi + offset) / 15  # the step that makes 15 steps reach the max
    d = _f16_at_least(span.max(axis=-1) / 63)
    scales = _ceil_codes(span, d.astype(np.float32)[:, None], 63)
    step = d.astype(np.float32)[:, None] * scales.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint((x + offset[..., None]) / step[..., None]), 0.0)
    q = np.clip(q, 0, 15).astype(np.uint8)  # [nb, 8, 32]

    packed = np.zeros((nb, 12), dtype=np.uint8)
    for j in range(4):
        packed[:, j] = scales[:, j] | ((scales[:, j + 4] >> 4) << 6)
        packed[:, j + 4] = mins[:, j] | ((mins[:, j + 4] >> 4) << 6)
        packed[:, j + 8] = (scales[:, j + 4] & 0xF) | ((mins[:, j + 4] & 0xF) << 4)
    pairs = q.reshape(nb, 4, 2, 32)  # sub-blocks (0,1), (2,3), ...: low then high nibbles
    codes = (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(nb, 128)
    blocks = np.concatenate(
        [d.reshape(nb, 1).view(np.uint8), dmin.reshape(nb, 1).view(np.uint8), packed, codes], axis=1
    )
    assert blocks.shape == (nb, Q4_K_BYTES)
    return blocks.reshape(rows, n // QK_K * Q4_K_BYTES)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """float32 ``[rows, n]`` (n % 256 == 0) -> uint8 ``[rows, n / 256 * 210]`` Q6_K blocks.

    Per sub-block of 16 the step ``d * scale_j`` is at least ``max(-min / 32, max / 31)``, so
    every value lies within the codes -32..31; each value takes its nearest code.
    """
    rows, n = weight.shape
    x = np.asarray(weight, dtype=np.float32).reshape(-1, 16, 16)
    nb = x.shape[0]
    need = np.maximum(-x.min(axis=-1) / 32, x.max(axis=-1) / 31)  # [nb, 16], >= 0
    d = _f16_at_least(need.max(axis=-1) / 127)
    scales = _ceil_codes(need, d.astype(np.float32)[:, None], 127)
    step = d.astype(np.float32)[:, None] * scales.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint(x / step[..., None]), 0.0)
    codes = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 128)  # 0..63, two halves

    ql = np.zeros((nb, 2, 64), dtype=np.uint8)
    qh = np.zeros((nb, 2, 32), dtype=np.uint8)
    for l in range(32):
        a, b, c, e = (codes[:, :, l + k] for k in (0, 32, 64, 96))
        ql[:, :, l] = (a & 0xF) | ((c & 0xF) << 4)
        ql[:, :, l + 32] = (b & 0xF) | ((e & 0xF) << 4)
        qh[:, :, l] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)
    blocks = np.concatenate(
        [ql.reshape(nb, 128), qh.reshape(nb, 64), scales.view(np.int8).view(np.uint8), d.reshape(nb, 1).view(np.uint8)],
        axis=1,
    )
    assert blocks.shape == (nb, Q6_K_BYTES)
    return blocks.reshape(rows, n // QK_K * Q6_K_BYTES)


QUANTIZERS = {GGMLQuantizationType.Q4_K: quantize_q4_k, GGMLQuantizationType.Q6_K: quantize_q6_k}


# ---- our decoder, written from ggml's dequantize_row_q4_K / dequantize_row_q6_K ---------------


def _half_at(blocks: np.ndarray, at: int) -> np.ndarray:
    """The little-endian float16 at byte ``at`` of every block, as float32."""
    bits = blocks[:, at].astype(np.uint16) | (blocks[:, at + 1].astype(np.uint16) << 8)
    return bits.view(np.float16).astype(np.float32)


def _scale_min_k4(j: int, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``get_scale_min_k4``: the 6-bit scale and min codes of sub-block ``j`` (0..7)."""
    if j < 4:
        return s[:, j] & 63, s[:, j + 4] & 63
    return (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4), (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)


def decode_q4_k(data: np.ndarray) -> np.ndarray:
    """Q4_K bytes ``[rows, k * 144]`` -> float32 ``[rows, k * 256]``."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, Q4_K_BYTES)
    d, dmin = _half_at(blocks, 0), _half_at(blocks, 2)
    s, qs = blocks[:, 4:16], blocks[:, 16:]
    out = np.empty((blocks.shape[0], QK_K), dtype=np.float32)
    for chunk in range(4):  # 64 values: sub-blocks 2*chunk (low nibbles) and 2*chunk+1 (high)
        q = qs[:, 32 * chunk : 32 * chunk + 32]
        for half, nibbles in ((0, q & 0xF), (1, q >> 4)):
            sc, m = _scale_min_k4(2 * chunk + half, s)
            scale = d * sc.astype(np.float32)
            offset = dmin * m.astype(np.float32)
            start = 64 * chunk + 32 * half
            out[:, start : start + 32] = scale[:, None] * nibbles.astype(np.float32) - offset[:, None]
    return out.reshape(rows, -1)


def decode_q6_k(data: np.ndarray) -> np.ndarray:
    """Q6_K bytes ``[rows, k * 210]`` -> float32 ``[rows, k * 256]``."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, Q6_K_BYTES)
    d = _half_at(blocks, 208)
    out = np.empty((blocks.shape[0], QK_K), dtype=np.float32)
    for n in range(2):  # halves of 128 values: 64 bytes of ql, 32 of qh, 8 scales each
        ql = blocks[:, 64 * n : 64 * n + 64]
        qh = blocks[:, 128 + 32 * n : 128 + 32 * n + 32]
        sc = blocks[:, 192 + 8 * n : 192 + 8 * n + 8].view(np.int8).astype(np.float32)
        for l in range(32):
            i = l // 16
            q1 = ((ql[:, l] & 0xF) | (((qh[:, l] >> 0) & 3) << 4)).astype(np.int8) - 32
            q2 = ((ql[:, l + 32] & 0xF) | (((qh[:, l] >> 2) & 3) << 4)).astype(np.int8) - 32
            q3 = ((ql[:, l] >> 4) | (((qh[:, l] >> 4) & 3) << 4)).astype(np.int8) - 32
            q4 = ((ql[:, l + 32] >> 4) | (((qh[:, l] >> 6) & 3) << 4)).astype(np.int8) - 32
            base = 128 * n + l
            for k, (q, j) in enumerate(((q1, i), (q2, i + 2), (q3, i + 4), (q4, i + 6))):
                out[:, base + 32 * k] = d * sc[:, j] * q.astype(np.float32)
    return out.reshape(rows, -1)


DECODERS = {GGMLQuantizationType.Q4_K: decode_q4_k, GGMLQuantizationType.Q6_K: decode_q6_k}
BLOCK_BYTES = {GGMLQuantizationType.Q4_K: Q4_K_BYTES, GGMLQuantizationType.Q6_K: Q6_K_BYTES}
D_OFFSETS = {GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q6_K: (208,)}


# ---- error bounds from the data ---------------------------------------------------------------


def _q4_k_error_bound(weight: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Per value: half a step of its sub-block, the step bounded by the sub-block's range.

    With ``m_j = dmin * ceil(-min / dmin) <= -min + dmin`` and ``d_j = d * ceil((max + m_j) / 15 d)``
    the step is at most ``(max - min + dmin) / 15 + d``; ``d`` and ``dmin`` (read from the
    block) are themselves checked to be the float16 of ``max_j(...) / 63``, rounded up.
    """
    x = weight.reshape(-1, 8, 32)
    b = blocks.reshape(-1, Q4_K_BYTES)
    d, dmin = _half_at(b, 0)[:, None], _half_at(b, 2)[:, None]
    lo, hi = np.minimum(x.min(axis=-1), 0.0), x.max(axis=-1)
    assert np.all(dmin[:, 0] <= (-lo).max(axis=-1) / 63 * F16_SLACK + 1e-7)
    assert np.all(d[:, 0] <= ((hi - lo + dmin) / 15).max(axis=-1) / 63 * F16_SLACK + 1e-7)
    step = (hi - lo + dmin) / 15 + d
    rounding = 8 * F32_EPS * np.abs(x).max(axis=(1, 2))[:, None, None]  # float32 arithmetic
    return np.broadcast_to(step[..., None] / 2 + rounding, x.shape).reshape(weight.shape)


def _q6_k_error_bound(weight: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Per value: half a step of its sub-block; step <= max(-min / 32, max / 31) + d, d <= max_j / 127."""
    x = weight.reshape(-1, 16, 16)
    d = _half_at(blocks.reshape(-1, Q6_K_BYTES), 208)[:, None]
    need = np.maximum(-x.min(axis=-1) / 32, x.max(axis=-1) / 31)
    assert np.all(d[:, 0] <= need.max(axis=-1) / 127 * F16_SLACK + 1e-7)
    step = need + d
    rounding = 8 * F32_EPS * np.abs(x).max(axis=(1, 2))[:, None, None]
    return np.broadcast_to(step[..., None] / 2 + rounding, x.shape).reshape(weight.shape)


ERROR_BOUNDS = {GGMLQuantizationType.Q4_K: _q4_k_error_bound, GGMLQuantizationType.Q6_K: _q6_k_error_bound}
KQUANTS = [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K]


def _awkward_weights(rng) -> np.ndarray:
    """Rows of 512 with per-row scales and outliers, plus sub-blocks that are all zero, constant,
    all positive or all negative, and a super-block so small that its float16 scales are subnormal."""
    w = rng.standard_normal((12, 512)).astype(np.float32) * np.geomspace(1e-3, 3.0, 12, dtype=np.float32)[:, None]
    w[0, :256] = 0.0
    w[1, :32] = 0.7
    w[2, :64] = np.abs(w[2, :64]) + 0.5
    w[3, 32:96] = -np.abs(w[3, 32:96]) - 0.25
    w[4, rng.integers(0, 512, 6)] *= 40.0  # outliers widen their sub-blocks only
    w[5, :256] *= 1e-4
    return w


# ---- tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda t: t.name)
def test_gguf_decodes_random_blocks_like_the_ggml_layout(qtype):
    """Every bit pattern of codes and packed scales, with finite float16 super-block scales."""
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(64, 4 * BLOCK_BYTES[qtype]), dtype=np.uint8)
    blocks = raw.reshape(-1, BLOCK_BYTES[qtype])
    for at in D_OFFSETS[qtype]:
        halves = (rng.standard_normal(blocks.shape[0]) * 0.05).astype(np.float16)
        blocks[:, at : at + 2] = halves.reshape(-1, 1).view(np.uint8)
    ours = DECODERS[qtype](raw)
    assert ours.shape == (64, 4 * QK_K) and np.isfinite(ours).all()
    theirs = gguf.quants.dequantize(raw, qtype)
    assert theirs.shape == ours.shape
    np.testing.assert_array_equal(theirs, ours)


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda t: t.name)
def test_k_quant_round_trip_stays_within_half_a_step(qtype):
    weight = _awkward_weights(np.random.default_rng(3))
    blocks = QUANTIZERS[qtype](weight)
    assert blocks.dtype == np.uint8 and blocks.shape == (12, 2 * BLOCK_BYTES[qtype])
    ours = DECODERS[qtype](blocks)
    np.testing.assert_array_equal(gguf.quants.dequantize(blocks, qtype), ours)
    error = np.abs(ours - weight)
    bound = ERROR_BOUNDS[qtype](weight, blocks)
    assert np.all(error <= bound), (
        f"worst excess {np.max(error - bound)} at {np.unravel_index(np.argmax(error - bound), error.shape)}"
    )
    assert np.all(ours[0, :256] == 0.0) and np.all(np.abs(ours[1, :32] - 0.7) <= bound[1, :32])
    # the bound is not loose: the error reaches a good part of it somewhere (nearest-code rounding)
    assert np.max(error[6:] / bound[6:]) > 0.8
    # and the codes use their range: a random row's relative RMS error is that of 4 / 6 bits
    rel = np.sqrt(np.mean((ours[6:] - weight[6:]) ** 2, axis=1)) / np.sqrt(np.mean(weight[6:] ** 2, axis=1))
    assert rel.max() < (0.12 if qtype == GGMLQuantizationType.Q4_K else 0.03)


def _tiny_hf():
    torch.manual_seed(2024)
    return HFLlama(LlamaConfig(**TINY)).eval()


def _hf_greedy(model, prompt):
    return hf_greedy(model, prompt, NEW_TOKENS)


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda t: t.name)
def test_k_quant_gguf_loads_exactly_and_generates_like_transformers(tmp_path, monkeypatch, qtype):
    hf_model = _tiny_hf()
    original_quantize = gguf.quants.quantize

    def quantize(array, asked):  # what write_llama_gguf calls for each 2-D tensor
        return QUANTIZERS[asked](array) if asked in QUANTIZERS else original_quantize(array, asked)

    monkeypatch.setattr(gguf.quants, "quantize", quantize)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_llama_gguf(path, hf_model, qtype)
    monkeypatch.undo()

    source = resolve_model_source(str(tmp_path))
    assert source.format == "gguf" and source.path == str(path) and source.architecture == "LlamaForCausalLM"
    config = source.hf_config
    assert (config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]) == (256, 512, 8)
    assert (config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (2, 32, 97)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert {n for n, t in types.items() if t == qtype} == {t.name for t in reader.tensors if len(t.shape) == 2}
    assert sum(t == qtype for t in types.values()) == 2 + 7 * TINY["num_hidden_layers"]

    # What the file holds, in HF row order: blocks lie within rows, so quantizing commutes with
    # llama.cpp's Q/K row permutation and the loader must return exactly our decode.
    expected = {}
    for name, tensor in hf_model.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        expected[name] = DECODERS[qtype](QUANTIZERS[qtype](array)) if array.ndim == 2 else array
    weights = dict(iterate_gguf(source.path))
    assert set(weights) == set(expected)
    for name, array in weights.items():
        assert array.dtype == np.float32 and array.shape == expected[name].shape, name
        np.testing.assert_array_equal(array, expected[name], err_msg=name)

    hf_model.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()})
    model = LlamaForCausalLM(config)
    model.eval()
    load_model_weights(model, source)
    ref_logits, ref_tokens = _hf_greedy(hf_model, PROMPT)
    harness = PagedHarness(model, num_blocks=6, block_size=8)
    generated, first = harness.generate([PROMPT], NEW_TOKENS, block_tables=[[4, 1, 5, 0]])
    assert np.abs(first[0] - ref_logits).max() < 1e-3
    assert generated[0] == ref_tokens
    assert len(set(ref_tokens)) > 3  # the model says something, not one token over and over
