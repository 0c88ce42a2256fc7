"""``fd_greedy_head``: the greedy tokens of the float32 LM head through the int8 screen.

The contract is exact: the kernel must return ``fd_argmax(fd_f32_linear(hidden, weight))`` for
the same batch, so every comparison here is ``==`` on token ids. The data plants what could
catch a wrong shortcut: exact ties (a copy of a row's best column before and after it),
near-ties whose float32 order depends on the summation order (copies moved by about an ulp
per weight, orthogonally to the row), rows of NaN / inf, a zero row and a flat head (all
tiles recomputed), batch sizes whose last rows fd_f32_linear sums with two chains (B % 8 in
1, 2) and with one (3 .. 7), a vocabulary of an odd number of 32-column tiles and K not a
multiple of 4.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np
import paddle
import pytest

from fastdeploy_core.devices.reference_ops import ReferenceOps
from fastdeploy_core.builtin.cpu.layout import pack_column_tiles
from fastdeploy_core.builtin.cpu.ops import CpuOps
from fastdeploy_core.builtin.cpu.kernels import has_int8_dot
from fastdeploy_core.testing.checks import head_with_near_ties

TILES = 37  # an odd number of 32-column tiles
V = 32 * TILES


def full_path(cpu_kernels, x: np.ndarray, packed: paddle.Tensor) -> np.ndarray:
    """What the runner computes without the greedy head: fd_argmax over fd_f32_linear's logits."""
    return cpu_kernels.fd_argmax(cpu_kernels.fd_f32_linear(paddle.to_tensor(x), packed)).numpy()


def greedy(cpu_kernels, x: np.ndarray, packed: paddle.Tensor, state) -> tuple[np.ndarray, np.ndarray]:
    tokens, tiles = cpu_kernels.fd_greedy_head(paddle.to_tensor(x), packed, *state)
    return tokens.numpy(), tiles.numpy()


def head_with_ties(rng, x: np.ndarray, K: int) -> np.ndarray:
    """The conformance kit's head with planted ties and near-ties for the first 12 rows of ``x``:
    the best column of each has an exact copy before and after it and three near-copies that
    only float32 rounding (the summation order) tells apart from it."""
    assert x.shape[1] == K
    return head_with_near_ties(rng, x, V, max_rows=12)


def case(seed: int, batch: int, K: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, K)).astype(np.float32)
    x[:, rng.integers(K, size=2)] *= 12.0  # outlier channels, as real hidden states have
    w = head_with_ties(rng, x, K)
    return x, pack_column_tiles(paddle.to_tensor(w))


@pytest.mark.parametrize("batch", [1, 2, 3, 8, 10, 16, 17, 64])
@pytest.mark.parametrize("K", [64, 70])
def test_tokens_equal_the_full_path(cpu_kernels, batch, K):
    x, packed = case(batch * 100 + K, batch, K)
    state = cpu_kernels.fd_greedy_head_prepare(packed)
    tokens, tiles = greedy(cpu_kernels, x, packed, state)
    want = full_path(cpu_kernels, x, packed)
    assert tokens.tolist() == want.tolist()
    assert (tiles >= 1).all() and (tiles <= TILES).all()


def test_near_ties_depend_on_the_summation_order(cpu_kernels):
    """The planted near-ties are real: fd_f32_linear's one-chain (batch 8) and two-chain
    (batch 1) orders pick different tokens for some rows, so a kernel that recomputed a tile
    with the other order would fail test_tokens_equal_the_full_path."""
    differ = 0
    for seed in range(6):
        x, packed = case(seed, 8, 70)
        batch8 = full_path(cpu_kernels, x, packed)
        alone = np.array([full_path(cpu_kernels, x[r : r + 1], packed)[0] for r in range(8)])
        differ += int((batch8 != alone).sum())
        state = cpu_kernels.fd_greedy_head_prepare(packed)
        assert greedy(cpu_kernels, x, packed, state)[0].tolist() == batch8.tolist()
        assert [greedy(cpu_kernels, x[r : r + 1], packed, state)[0][0] for r in range(8)] == alone.tolist()
    assert differ > 0, "no planted near-tie depends on the summation order: the data cannot catch a wrong order"


def test_screen_recomputes_few_tiles(cpu_kernels):
    """On a peaked distribution the screen leaves a few tiles of 37 (else the kernel is only exact, not fast)."""
    rng = np.random.default_rng(5)
    K = 64
    w = (rng.standard_normal((K, V)) / np.sqrt(K)).astype(np.float32)
    x = (w[:, rng.integers(V, size=8)].T * 6.0).astype(np.float32)  # each row points at one column
    packed = pack_column_tiles(paddle.to_tensor(w))
    tokens, tiles = greedy(cpu_kernels, x, packed, cpu_kernels.fd_greedy_head_prepare(packed))
    assert tokens.tolist() == full_path(cpu_kernels, x, packed).tolist()
    if has_int8_dot():
        assert tiles.max() <= 3, tiles


def test_non_finite_zero_tiny_and_huge_rows(cpu_kernels):
    x, packed = case(7, 9, 70)
    x[1, 3] = np.nan
    x[2, 5] = np.inf
    x[3, :] = np.nan
    x[4, :] = 0.0  # every logit 0: the first index
    x[5, 0] = -np.inf
    x[6] *= np.float32(1e-37)  # products underflow: the bound's absolute term
    x[7] *= np.float32(1e28)  # large but safely finite: screened as usual
    x[8] *= np.float32(1e37)  # logits could overflow: the whole row
    state = cpu_kernels.fd_greedy_head_prepare(packed)
    tokens, tiles = greedy(cpu_kernels, x, packed, state)
    assert tokens.tolist() == full_path(cpu_kernels, x, packed).tolist()
    assert tiles[1:6].tolist() == [TILES] * 5
    assert tiles[8] == TILES
    assert tokens[4] == 0


def test_flat_head_falls_back_to_the_whole_row(cpu_kernels):
    """Columns that differ by ~1e-6 of their size: every tile is a candidate, the row is recomputed whole."""
    rng = np.random.default_rng(11)
    K = 64
    base = rng.standard_normal((K, 1)).astype(np.float32)
    w = (base + 1e-6 * rng.standard_normal((K, V))).astype(np.float32)
    x = rng.standard_normal((3, K)).astype(np.float32)
    packed = pack_column_tiles(paddle.to_tensor(w))
    tokens, tiles = greedy(cpu_kernels, x, packed, cpu_kernels.fd_greedy_head_prepare(packed))
    assert tokens.tolist() == full_path(cpu_kernels, x, packed).tolist()
    if has_int8_dot():
        assert tiles.tolist() == [TILES] * 3


def test_wrong_screen_is_refused(cpu_kernels):
    x, packed = case(1, 2, 64)
    _, other = case(1, 2, 70)
    with pytest.raises(Exception, match="screen must be fd_greedy_head_prepare"):
        cpu_kernels.fd_greedy_head(paddle.to_tensor(x), packed, *cpu_kernels.fd_greedy_head_prepare(other))


def test_cpu_ops_greedy_lm_head_is_its_linear_and_argmax(cpu_kernels):
    ops = CpuOps()
    x, _ = case(3, 16, 70)
    w = head_with_ties(np.random.default_rng(3), x, 70)
    packed = ops.prepare_linear_weight(paddle.to_tensor(w))
    prepared = ops.prepare_greedy_head(packed)
    if has_int8_dot():
        assert prepared is not None
    hidden = paddle.to_tensor(x)
    want = ops.argmax_rows(ops.linear(hidden, packed))
    assert ops.greedy_lm_head(hidden, packed, None, prepared).tolist() == want.tolist()
    assert ops.greedy_lm_head(hidden, packed).tolist() == want.tolist()  # nothing prepared: the composition
    # The reference table's own composition on the plain layout.
    ref = ReferenceOps()
    plain = paddle.to_tensor(w)
    assert ref.greedy_lm_head(hidden, plain).tolist() == ref.argmax_rows(ref.linear(hidden, plain)).tolist()


def test_cpu_ops_prepares_no_screen_for_a_non_finite_head(cpu_kernels):
    ops = CpuOps()
    w = np.ones((64, 64), np.float32)
    w[3, 7] = np.nan
    assert ops.prepare_greedy_head(ops.prepare_linear_weight(paddle.to_tensor(w))) is None
    assert ops.prepare_greedy_head(paddle.to_tensor(np.ones((64, 64), np.float32))) is None  # plain layout
