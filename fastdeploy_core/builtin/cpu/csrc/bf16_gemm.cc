// bfloat16 linear layers for the cpu device (--dtype bfloat16): y[M, N] = bf16(x)[M, K] @ W[K, N],
// W stored in bfloat16, the products accumulated in float32, y float32.
//
// Layout. W is [N / 32, K2, 32, 2] bfloat16, K2 = K / 2 (the cpu ops pack even K only; an odd K
// would take a zero pad row, which x's rounding matches with a zero): element (t, j, c, e) is
// W[2 j + e, 32 t + c]. One 64-byte load is then 16 columns x one pair
// of consecutive k, each 32-bit lane one column's pair, which is what vdpbf16ps multiplies; a
// tile's 32 columns are one contiguous stream over K, like fd_f32_linear's column tiles.
//
// Activations. Each call first rounds the rows of x to bfloat16 (round to nearest, ties to
// even; NaN stays NaN; subnormals are rounded like any value), as Paddle's astype("bfloat16")
// does: the reference formula is x.astype(bf16) @ W.astype(float32). x may also be bfloat16 rows
// that a kernel before already rounded (fd_bf16_linear_silu's SwiGLU), read as they are.
//
// Two paths compute the same sums in the same order, so they agree bit for bit (the products of
// two bfloat16 values are exact in float32; only the additions round):
//   dot   (AVX-512 BF16, vdpbf16ps): per k pair, acc += x[2j+1] w[2j+1], then acc += x[2j] w[2j],
//         each addition rounded to float32 (the instruction's definition). The instruction
//         treats subnormal bfloat16 inputs as zero and flushes a subnormal result to zero, which
//         only values below ~1e-38 can notice.
//   widen (any CPU): the bfloat16 weights are widened to float32 in the tile loop and the same
//         two additions per pair run as float32 multiply-adds (exact products: an FMA rounds once,
//         like the addition alone).
// One accumulation chain per output column (k pairs in order), whatever rows share a tile.
// The path is chosen at run time by CPU feature (__builtin_cpu_supports("avx512bf16"), which
// also asks the OS for the AVX-512 register state); the dot path is compiled for AVX-512 BF16
// through a target attribute, so the library builds on compilers' default targets too.
//   amx   (AMX-BF16, tdpbf16ps; amx_tiles.h): 32 x 32 blocks of sums in tiles, 16 k pairs per
//         instruction. Its order is the instruction's, not the two paths' above: per instruction
//         and output, two chains (even and odd k) from zero, then their sum added to the output
//         (the SDM's Operation section), so its bits differ from theirs; tests compare it
//         bit for bit with an emulation of that order. That order depends on K alone, never on the rows beside a row, so
//         a request's results do not depend on its batch: on an AMX CPU the auto path takes
//         tiles at every row count (one decode row too), never the dot path for some steps.
//         Before its first use the process checks the tile path once against the widen path on
//         a small problem; a disagreement is printed and the dot path is used instead.
//         ModelTiles, a software model of the instructions, runs the same loop on any CPU
//         (path 4, for tests); on an AMX CPU the instructions give its bits.
// `path`: 0 = the CPU's best (amx, else dot, else widen), 1 = widen, 2 = dot (an error without
// AVX-512 BF16), 3 = amx (an error without AMX-BF16), 4 = the amx loop on the tile model.
//
// Threads (row_panels.h) claim (panel of 64 rows, one or two column tiles) items; each tile
// runs the panel's rows in blocks of 8, so rows reuse a tile's weights from cache and a panel's
// activations stay in L2 across its tiles. The amx path's items are (panel of up to 512 rows, a
// group of up to 16 tiles), a block of 32 rows at a time across the group (run_tile_groups).
//
// A call of more than kWidenOnceRows rows takes the widen path another way: each
// tile's weights are widened once into a float32 buffer [K2 pairs x 2, 32], the odd k of each pair
// first, and x's rounded values are laid out in the same order, so fd_f32_linear's many-row loop
// (f32_tiles.h, one chain per output) runs the very same multiply-adds in the same order: the
// same bits, at float32's speed instead of widening each weight again for every block of rows.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "cpu_features.h"
#include "f32_tiles.h"
#include "graph.h"
#include "paddle/extension.h"
#include "row_panels.h"
#include "thread_pool.h"
#include "tile_argmax.h"
#include "vector_math.h"

namespace {

using fd_kernels::f32x16;
using fd_kernels::u32x16;

constexpr int64_t kCols = 32;               // output columns per tile
constexpr int64_t kPairBytes = kCols * 4;   // one k pair of one tile: 32 columns x 2 bf16
constexpr int64_t kPrefetchBytes = 2048;    // how far ahead a tile asks for its weight stream
constexpr int kRows = 8;                    // rows of x per tile block

enum Path : int64_t { kAuto = 0, kWiden = 1, kDot = 2, kAmx = 3, kAmxModel = 4 };

using fd_kernels::cpu_has_bf16_dot;

using fd_kernels::round_bf16_lanes;
using fd_kernels::to_bf16;

// Row m of x as bf16 pairs: xb[m * stride + j] holds x[2j] in its low and x[2j + 1] in its
// high half, rounded; an odd K ends with a zero half. (Every path reads these 32-bit pairs.)
void round_rows(const float* x, int64_t M, int64_t K, int64_t K2, uint32_t* xb, int64_t stride) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    uint32_t* out = xb + m * stride;
    int64_t j = 0;
    for (; 2 * j + 32 <= K; j += 16) {
      fd_kernels::store(out + j, fd_kernels::bf16_pairs32(fd_kernels::load16(row + 2 * j), fd_kernels::load16(row + 2 * j + 16)));
    }
    for (; j < K2; ++j) {
      const uint32_t lo = to_bf16(row[2 * j]);
      const uint32_t hi = 2 * j + 1 < K ? to_bf16(row[2 * j + 1]) : 0u;
      out[j] = lo | (hi << 16);
    }
  }
}

// The rows of x as bf16 pairs for a call's GEMM: `rows` rows of `stride` pairs (M rounded rows,
// zeros past K2 and past M), in this thread's buffer, which the next call on the thread reuses.
// The pool's threads round 16-row chunks side by side. (A fresh buffer per call cost a 512-row
// call of K = 1536 ~300 us of page faults and zeroing on one thread, beside ~100 us of AMX work.)
uint32_t* row_buffer(int64_t rows, int64_t stride) {
  thread_local fd_amx::TileBuffer<uint32_t> buffer;
  if (buffer.size() < static_cast<size_t>(rows * stride)) buffer.resize(static_cast<size_t>(rows * stride));
  return buffer.data();
}

const uint32_t* rounded_rows(const float* x, int64_t M, int64_t K, int64_t K2, int64_t rows, int64_t stride) {
  uint32_t* xb = row_buffer(rows, stride);
  fd_kernels::run_row_chunks<16>(M, [=](int64_t m0, int64_t m1) {
    round_rows(x + m0 * K, m1 - m0, K, K2, xb + m0 * stride, stride);
    for (int64_t m = m0; stride > K2 && m < m1; ++m) std::fill(xb + m * stride + K2, xb + (m + 1) * stride, 0u);
  });
  std::fill(xb + M * stride, xb + rows * stride, 0u);
  return xb;
}

// bfloat16 rows of x (already rounded: fd_bf16_linear_silu's output, say) as the GEMM's pairs:
// read in place when they already are its layout (K even, K2 = stride, rows = M, 64-byte
// aligned), else copied into the buffer rounded_rows fills, zeros past K and M. (A bfloat16 x
// gives what its float32 widening gives: rounding a bfloat16 value changes nothing.)
const uint32_t* bf16_rows(const uint16_t* x, int64_t M, int64_t K, int64_t K2, int64_t rows, int64_t stride) {
  if (K == 2 * K2 && stride == K2 && rows == M && reinterpret_cast<uintptr_t>(x) % 64 == 0)
    return reinterpret_cast<const uint32_t*>(x);
  uint32_t* xb = row_buffer(rows, stride);
  fd_kernels::run_row_chunks<16>(M, [=](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      uint32_t* out = xb + m * stride;
      std::memcpy(out, x + m * K, K * sizeof(uint16_t));
      uint16_t* halves = reinterpret_cast<uint16_t*>(out);
      std::fill(halves + K, halves + 2 * stride, uint16_t{0});
    }
  });
  std::fill(xb + M * stride, xb + rows * stride, 0u);
  return xb;
}

// x's rows (float32, rounded here, or bfloat16) as the GEMM's bf16 pairs: `rows` rows of `stride`
// pairs (see rounded_rows).
const uint32_t* pair_rows(const paddle::Tensor& x, int64_t M, int64_t K, int64_t K2, int64_t rows, int64_t stride) {
  if (x.dtype() == paddle::DataType::BFLOAT16)
    return bf16_rows(static_cast<const uint16_t*>(x.data()), M, K, K2, rows, stride);
  return rounded_rows(x.data<float>(), M, K, K2, rows, stride);
}

struct Problem {
  const uint32_t* xb;  // [M, K2] bf16 pairs
  const uint8_t* w;    // [N / 32, K2, 32, 2]
  float* y;            // [M, N]
  int64_t M, K2, N;
};

// The widen path: ROWS rows from m times tile t.
template <int ROWS>
void widen_tile(const Problem& p, int64_t m, int64_t t) {
  f32x16 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = f32x16{};
  const uint8_t* tile = p.w + t * p.K2 * kPairBytes;
  for (int64_t j = 0; j < p.K2; ++j) {
    const uint8_t* src = tile + j * kPairBytes;
    if (ROWS <= 2) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes), _MM_HINT_T0);
    if (ROWS <= 2) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes + 64), _MM_HINT_T0);
    const u32x16 v0 = fd_kernels::load<u32x16>(reinterpret_cast<const uint32_t*>(src));
    const u32x16 v1 = fd_kernels::load<u32x16>(reinterpret_cast<const uint32_t*>(src + 64));
    using fd_kernels::bitcast;
    const f32x16 we0 = bitcast<f32x16>(v0 << 16u), wo0 = bitcast<f32x16>(v0 & 0xFFFF0000u);
    const f32x16 we1 = bitcast<f32x16>(v1 << 16u), wo1 = bitcast<f32x16>(v1 & 0xFFFF0000u);
    for (int r = 0; r < ROWS; ++r) {
      const uint32_t pair = p.xb[(m + r) * p.K2 + j];
      float xe, xo;
      const uint32_t e = pair << 16, o = pair & 0xFFFF0000u;
      std::memcpy(&xe, &e, 4);
      std::memcpy(&xo, &o, 4);
      // vdpbf16ps's order: the odd k of the pair first.
      acc[r][0] += xo * wo0;
      acc[r][1] += xo * wo1;
      acc[r][0] += xe * we0;
      acc[r][1] += xe * we1;
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    fd_kernels::store16(p.y + (m + r) * p.N + t * kCols, acc[r][0]);
    fd_kernels::store16(p.y + (m + r) * p.N + t * kCols + 16, acc[r][1]);
  }
}

#if defined(__x86_64__)
// The dot path: ROWS rows from m times tile t with vdpbf16ps.
template <int ROWS>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void dot_tile(const Problem& p, int64_t m, int64_t t) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint8_t* tile = p.w + t * p.K2 * kPairBytes;
  for (int64_t j = 0; j < p.K2; ++j) {
    const uint8_t* src = tile + j * kPairBytes;
    if (ROWS <= 2) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes), _MM_HINT_T0);
    if (ROWS <= 2) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes + 64), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(src);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(src + 64);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(p.xb[(m + r) * p.K2 + j]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    _mm512_storeu_ps(p.y + (m + r) * p.N + t * kCols, acc[r][0]);
    _mm512_storeu_ps(p.y + (m + r) * p.N + t * kCols + 16, acc[r][1]);
  }
}
#endif

// Rows per block of the widen path: kRows, or 4 without AVX-512 (vector_math.h's register
// pairs; on an AVX2 EPYC 7002, [M, 576] x [576, 1536]: blocks of 2 rows 676 / 5200 us at M = 16 /
// 128, of 4 575 / 4424, of 6 alike; float32's fd_f32_linear 361 / 2326 us: why calls of more rows
// now widen each tile once instead, gemm_widened_once).
#if defined(__AVX512F__)
constexpr int kWidenBlock = kRows;
#else
constexpr int kWidenBlock = 4;
#endif

// Rows above which the widen path widens each tile once (see the top of the file), 2 threads,
// one op call each. AVX2 EPYC 7002 (2026-12-03), [M, 576] x [576, 1536]: M = 5 / 8 alike either
// way (119 / 168 us), M = 16 / 64 / 512 318 / 1201 / 9658 -> 259 / 735 / 5384 us (fd_f32_linear:
// 197 / 631 / 4873 us). AVX-512 without BF16, Ice Lake Xeon (2026-12-07), the same shape: M = 8
// alike (127 / 125 us), M = 16 / 64 / 512 213 / 804 / 6575 -> 184 / 517 / 4038 us (fd_f32_linear
// 168 / 477 / 3898); [M, 1536] x [1536, 576] and the head [M, 576] x [576, 49152] alike at 10.
#if defined(__AVX512F__)
constexpr int64_t kWidenOnceRows = 10;
#else
constexpr int64_t kWidenOnceRows = 4;
#endif

// x's rounded pairs as float32 [M, 2 K2], the odd k of each pair first (the widen path's order).
void pair_major_rows(const uint32_t* xb, int64_t M, int64_t K2, float* xf) {
  for (int64_t i = 0; i < M * K2; ++i) {
    const uint32_t odd = xb[i] & 0xFFFF0000u, even = xb[i] << 16;
    std::memcpy(xf + 2 * i, &odd, 4);
    std::memcpy(xf + 2 * i + 1, &even, 4);
  }
}

// Tile t's weights as float32 [2 K2, 32] in the same order: row 2 j holds W[2 j + 1], row 2 j + 1 W[2 j].
void widen_tile_once(const Problem& p, int64_t t, float* buf) {
  const uint8_t* tile = p.w + t * p.K2 * kPairBytes;
  using fd_kernels::bitcast;
  for (int64_t j = 0; j < p.K2; ++j) {
    const uint8_t* src = tile + j * kPairBytes;
    for (int h = 0; h < 2; ++h) {
      const u32x16 v = fd_kernels::load<u32x16>(reinterpret_cast<const uint32_t*>(src + 64 * h));
      fd_kernels::store16(buf + (2 * j) * kCols + 16 * h, bitcast<f32x16>(v & 0xFFFF0000u));
      fd_kernels::store16(buf + (2 * j + 1) * kCols + 16 * h, bitcast<f32x16>(v << 16u));
    }
  }
}

struct OnceJob {
  const Problem* p;
  const float* xf;  // [M, 2 K2]
};

void widened_once_tile(void* ctx, int64_t t) {
  const OnceJob& j = *static_cast<OnceJob*>(ctx);
  const Problem& p = *j.p;
  float* buf = fd_kernels::tile_buffer(2 * p.K2);
  widen_tile_once(p, t, buf);
  fd_kernels::f32_tile_rows_one_chain(j.xf, p.M, 2 * p.K2, buf, t, p.N, p.y);
}

void gemm_widened_once(const Problem& p) {
  // The calling thread's, reused from call to call (every call writes all of it before reading).
  thread_local std::vector<float> xf;
  xf.resize(static_cast<size_t>(p.M * 2 * p.K2));
  pair_major_rows(p.xb, p.M, p.K2, xf.data());
  OnceJob job{&p, xf.data()};
  fd_kernels::Pool::instance().run(p.N / kCols, widened_once_tile, &job);
}

// The amx path: groups of tiles, a block of 32 rows at a time across each group
// (fd_amx::run_tile_blocks). xb is [rows rounded up to 16, K2 rounded up to 16] pairs, zero past
// x (the tiles read whole tiles). One block of rows of tile t of p (xb's rows x_stride groups
// apart) into the block's lines of y:
// Weight tile t of p against the block of rows from m (xb's rows x_stride groups apart).
fd_amx::PaddedTile weight_tile(const Problem& p, int64_t x_stride, int64_t m, int64_t t) {
  return fd_amx::PaddedTile(p.xb + m * x_stride, x_stride, p.w + t * p.K2 * kPairBytes, p.K2);
}

template <class Tiles>
void block_into_y(const Problem& p, int64_t x_stride, int64_t m, int64_t rows, int64_t t) {
  fd_amx::tile_block_into<Tiles>(fd_amx::Kind::kBf16, weight_tile(p, x_stride, m, t).op, rows,
                                 reinterpret_cast<uint8_t*>(p.y + m * p.N + t * kCols), p.N * 4);
}

// block(m, rows, t) for every block of rows of `tiles` tiles of p (fd_amx::run_tile_blocks), the
// panels sized for xb's rows.
template <class Tiles, class Block>
void run_blocks(const Problem& p, int64_t x_stride, int64_t tiles, const Block& block) {
  fd_amx::run_tile_blocks<Tiles>(p.M, tiles, fd_kernels::panel_rows_for(x_stride * 4), block);
}

template <class Tiles>
void gemm_amx(const Problem& p, int64_t x_stride) {
  run_blocks<Tiles>(p, x_stride, p.N / kCols, [&p, x_stride](int64_t m, int64_t rows, int64_t t) {
    block_into_y<Tiles>(p, x_stride, m, rows, t);
  });
}

// fd_bf16_linear on x [M, K] (float32 or bfloat16) through the amx loop (Tiles) into y.
template <class Tiles>
void linear_amx(const paddle::Tensor& x, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t K2, int64_t N) {
  const int64_t stride = fd_amx::padded_groups(K2);
  const uint32_t* xb = pair_rows(x, M, K, K2, fd_amx::padded_rows(M), stride);
  gemm_amx<Tiles>(Problem{xb, w, y, M, K2, N}, stride);
}

// fd_bf16_linear_silu's loop: y [M, N / 2] (bfloat16) = silu(gate) * up, gate and up the two
// halves of the [M, N] product (columns [0, N / 2) and [N / 2, N)), each item's group of tiles
// (run_tile_groups) one block of 32 rows at a time, for each tile t of the group gate tile t and up
// tile t + N / 64: both blocks' sums into L1 buffers, then the SwiGLU of the pair, rounded to
// bfloat16 (to_bf16), into y's line, claimed while the tiles multiply. The sums are
// fd_bf16_linear's amx path's (the tile order depends on K alone) and the epilogue is
// fd_silu_mul's formula, so the result is that of the two ops, rounded, bit for bit, without the
// [M, N] product going through memory: on a Xeon with AMX a 512-row [576, 3072] gate/up
// projection wrote 6 MB of it and fd_silu_mul read it back.
template <class Tiles>
void gate_up_silu_amx(const Problem& p, int64_t x_stride, uint16_t* y) {
  const int64_t half = p.N / kCols / 2, I = p.N / 2;
  run_blocks<Tiles>(p, x_stride, half, [&](int64_t m, int64_t rows, int64_t t) {
    uint16_t* ym = y + m * I + t * kCols;
    for (int64_t r = 0; r < rows; ++r)  // y's line asked for now, written after both products
      __builtin_prefetch(ym + r * I, 1, 3);
    alignas(64) float g[fd_amx::kBlockRows][kCols], u[fd_amx::kBlockRows][kCols];
    const fd_amx::PaddedTile gate = weight_tile(p, x_stride, m, t), up = weight_tile(p, x_stride, m, t + half);
    fd_amx::tile_block_rows<Tiles>(fd_amx::Kind::kBf16, gate.op, rows, reinterpret_cast<uint8_t*>(&g[0][0]), kCols * 4, false);
    fd_amx::tile_block_rows<Tiles>(fd_amx::Kind::kBf16, up.op, rows, reinterpret_cast<uint8_t*>(&u[0][0]), kCols * 4, false);
    for (int64_t r = 0; r < rows; ++r)  // the 32 values rounded to bfloat16 as round_rows does
      fd_kernels::store(reinterpret_cast<uint32_t*>(ym + r * I),
                        fd_kernels::bf16_pairs32(fd_kernels::silu_mul16(fd_kernels::load16(g[r]), fd_kernels::load16(u[r])),
                                                 fd_kernels::silu_mul16(fd_kernels::load16(g[r] + 16), fd_kernels::load16(u[r] + 16))));
  });
}

// fd_bf16_linear_argmax's loop: out[m] = the index of row m's largest value of x W (the first on
// ties, NaN as -inf: fd_argmax's rule) without the [M, N] logits going through memory: each
// block of 32 x 32 sums of a group's tiles (fd_bf16_linear's amx sums, the same bits) leaves the
// first largest value of each row's 32 columns in a table (tile_argmax.h), and a last pass takes
// each row's first largest over the tiles. On SmolLM2 the head's 49,152 float32 logits were
// 12.6 MB written and read again per decode step of 64 rows.
template <class Tiles>
void argmax_amx(const Problem& p, int64_t x_stride, int64_t* out) {
  const int64_t tiles = p.N / kCols;
  static_assert(kCols == 32, "TileBest takes 32-column tiles");
  fd_kernels::TileBest best(p.M, tiles);
  run_blocks<Tiles>(p, x_stride, tiles, [&](int64_t m, int64_t rows, int64_t t) {
    alignas(64) float sums[fd_amx::kBlockRows][kCols];
    fd_amx::tile_block_rows<Tiles>(fd_amx::Kind::kBf16, weight_tile(p, x_stride, m, t).op, rows,
                                   reinterpret_cast<uint8_t*>(&sums[0][0]), kCols * 4, false);
    best.put(t, m, rows, sums[0], kCols);
  });
  best.argmax(kCols, out);
}

void gemm(const Problem& p, bool dot) {
  if (!dot && p.M > kWidenOnceRows) return gemm_widened_once(p);
  const int64_t tiles = p.N / kCols;
#if defined(__x86_64__)
  if (dot) {
    fd_kernels::run_row_panels(p.M, tiles, [&p](int64_t t, int64_t m_begin, int64_t m_end) {
      fd_kernels::row_blocks<kRows>(m_begin, m_end, [&](auto rows, int64_t m) { dot_tile<decltype(rows)::value>(p, m, t); });
    });
    return;
  }
#endif
  fd_kernels::run_row_panels(p.M, tiles, [&p](int64_t t, int64_t m_begin, int64_t m_end) {
    fd_kernels::row_blocks<kWidenBlock>(m_begin, m_end,
                                        [&](auto rows, int64_t m) { widen_tile<decltype(rows)::value>(p, m, t); });
  });
}

std::vector<int64_t> out_shape(const std::vector<int64_t>& x_shape, int64_t n) {
  std::vector<int64_t> shape(x_shape.begin(), x_shape.end() - 1);
  shape.push_back(n);
  return shape;
}

// The tile loop (Tiles) against the widen path on a small problem: 40 rows (a block of 32 stored
// straight into the output and a part block through the buffer), K = 80 (whole pair tiles of 16 and a tail of 8 pairs), N = 64. The orders differ,
// so the agreement is a tolerance: |tiles - widen| <= 1e-5 sum_k |x w| + 1e-30 (that sum itself
// from the widen path on |x| and |w|). *worst gets the largest difference.
template <class Tiles>
bool tiles_agree_with_widen(float* worst) {
  constexpr int64_t M = 40, K = 80, K2 = K / 2, N = 64;
  std::vector<float> x(M * K), x_abs(M * K), bound(M * N), widen(M * N);
  fd_amx::TileBuffer<float> tiles(M * N);  // stored into as the GEMM's output is (64-byte aligned)
  std::vector<uint16_t> w(N * K), w_abs(N * K);
  uint32_t seed = 12345u;
  auto next = [&seed] {
    seed = seed * 1664525u + 1013904223u;
    return static_cast<float>(static_cast<int32_t>(seed >> 8) - (1 << 23)) / static_cast<float>(1 << 23);
  };
  for (int64_t i = 0; i < M * K; ++i) x_abs[i] = std::fabs(x[i] = next());
  for (int64_t i = 0; i < N * K; ++i) w_abs[i] = (w[i] = to_bf16(next())) & 0x7FFFu;
  std::vector<uint32_t> xb(M * K2);
  auto run_widen = [&](const float* xs, const uint16_t* ws, float* y) {
    round_rows(xs, M, K, K2, xb.data(), K2);
    const Problem p{xb.data(), reinterpret_cast<const uint8_t*>(ws), y, M, K2, N};
    for (int64_t t = 0; t < N / kCols; ++t)
      for (int64_t m = 0; m < M; ++m) widen_tile<1>(p, m, t);
  };
  run_widen(x.data(), w.data(), widen.data());
  run_widen(x_abs.data(), w_abs.data(), bound.data());
  const int64_t stride = fd_amx::padded_groups(K2);
  fd_amx::TileBuffer<uint32_t> xp(fd_amx::padded_rows(M) * stride, 0u);
  round_rows(x.data(), M, K, K2, xp.data(), stride);
  // gemm_amx's blocks for all the tiles at once, without its pool (a forked child has no workers)
  const Problem p{xp.data(), reinterpret_cast<const uint8_t*>(w.data()), tiles.data(), M, K2, N};
  fd_amx::group_blocks<Tiles>(0, N / kCols, 0, M, [&p, stride](int64_t m, int64_t rows, int64_t t) {
    block_into_y<Tiles>(p, stride, m, rows, t);
  });
  bool agree = true;
  *worst = 0.f;
  for (int64_t i = 0; i < M * N; ++i) {
    const float d = std::fabs(tiles[i] - widen[i]);
    agree = agree && d <= 1e-5f * bound[i] + 1e-30f;  // false for a NaN too
    *worst = std::max(*worst, d);
  }
  return agree;
}

// The tile path checked once in a forked child against the widen path (fd_amx::checked_state).
template <class Tiles>
bool tiles_agree() {
  float worst = 0.f;
  const bool agree = tiles_agree_with_widen<Tiles>(&worst);
  if (!agree) std::fprintf(stderr, "fd_bf16_linear: tiles vs widen path, |difference| up to %g\n", worst);
  return agree;
}

// Whether the auto path takes AMX tiles (AMX-BF16 granted by the OS, self-check passed).
fd_amx::State amx_state() {
#if defined(__x86_64__)
  static const fd_amx::State state = fd_amx::checked_state(fd_amx::Kind::kBf16, tiles_agree<fd_amx::HardwareTiles>,
                                                           "fd_bf16_linear", "the dot path");
  return state;
#else
  return fd_amx::kNoTiles;
#endif
}

// A stand-in for tiles that fault at their first instruction (the safety net's own test).
struct FaultingTiles : fd_amx::ModelTiles {
  static void configure(const fd_amx::TileConfig&) { __builtin_trap(); }
};

// The checks every fd_bf16_linear op makes of its inputs (the fused ones, `tiles_only`, take path
// 3 or 4 only): {K, K2, N}.
struct Shape {
  int64_t K, K2, N;
};
Shape checked_inputs(const paddle::Tensor& x, const paddle::Tensor& weight, int64_t path, bool tiles_only) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 || x.dtype() == paddle::DataType::BFLOAT16,
           "x must be float32 or bfloat16");
  PD_CHECK(weight.dtype() == paddle::DataType::BFLOAT16, "weight must be bfloat16");
  const auto& ws = weight.shape();
  PD_CHECK(ws.size() == 4 && ws[2] == kCols && ws[3] == 2, "weight must be packed [N / 32, K2, 32, 2]");
  if (tiles_only)
    PD_CHECK(path == kAmx || path == kAmxModel, "path must be 3 (amx) or 4 (amx on the tile model), got ", path);
  else
    PD_CHECK(path >= kAuto && path <= kAmxModel,
             "path must be 0 (auto), 1 (widen), 2 (dot), 3 (amx) or 4 (amx on the tile model), got ", path);
  PD_CHECK(path != kDot || cpu_has_bf16_dot(), "the dot path needs AVX-512 BF16, which this CPU does not have");
  PD_CHECK(path != kAmx || fd_amx::amx_permitted(fd_amx::Kind::kBf16),
           "the amx path needs AMX-BF16 tiles granted by the OS, which this CPU or kernel does not have");
  PD_CHECK(!x.shape().empty(), "x must have a last axis of K features");
  const int64_t K2 = ws[1], N = ws[0] * kCols, K = x.shape().back();
  PD_CHECK(K == 2 * K2 || K == 2 * K2 - 1, "x's last axis (", K, ") does not fit the weight's ", K2, " k pairs");
  return {K, K2, N};
}

}  // namespace

std::vector<paddle::Tensor> Bf16Linear(const paddle::Tensor& x_in, const paddle::Tensor& weight, int64_t path) {
  const Shape shape = checked_inputs(x_in, weight, path, false);
  const int64_t K = shape.K, K2 = shape.K2, N = shape.N;
  const bool amx = path == kAmx || (path == kAuto && amx_state() == fd_amx::kTilesInUse);
  const bool dot = path == kDot || (path == kAuto && cpu_has_bf16_dot());
  auto out = fd_graph::empty(out_shape(x_in.shape(), N), paddle::DataType::FLOAT32);
  fd_graph::run("fd_bf16_linear", {&x_in, &weight}, {&out}, [=]() mutable {
    const paddle::Tensor x = x_in.contiguous();
    const int64_t M = K > 0 ? x.numel() / K : 0;
    const auto* w = static_cast<const uint8_t*>(weight.data());
    if (amx || path == kAmxModel)
      return fd_amx::on_tiles(amx, [&](auto tiles) { linear_amx<decltype(tiles)>(x, w, out.data<float>(), M, K, K2, N); });
    gemm(Problem{pair_rows(x, M, K, K2, M, K2), w, out.data<float>(), M, K2, N}, dot);
  });
  return {out};
}

// silu(gate) * up of the linear's two output halves (SwiGLU on a merged gate/up projection),
// through AMX tiles: `path` 3 the instructions (an error without AMX-BF16 tiles), 4 their
// software model. bfloat16 [M, N / 2]: fd_bf16_linear on the same path followed by fd_silu_mul,
// rounded to bfloat16 as fd_bf16_linear rounds its input, bit for bit; what the next bf16 linear
// (the down projection) reads as it is, so the SwiGLU crosses memory in half the bytes and is
// rounded once, here (a 2,048-row step wrote 12.6 MB of float32 and the down projection read
// and rounded them again).
std::vector<paddle::Tensor> Bf16LinearSilu(const paddle::Tensor& x_in, const paddle::Tensor& weight, int64_t path) {
  const Shape shape = checked_inputs(x_in, weight, path, true);
  const int64_t K = shape.K, K2 = shape.K2, N = shape.N;
  PD_CHECK(N % (2 * kCols) == 0, "the gate and up halves must be whole tiles of 32 columns each (N = ", N,
           " is not a multiple of 64)");
  auto out = fd_graph::empty(out_shape(x_in.shape(), N / 2), paddle::DataType::BFLOAT16);
  fd_graph::run("fd_bf16_linear_silu", {&x_in, &weight}, {&out}, [=]() mutable {
    const paddle::Tensor x = x_in.contiguous();
    const int64_t M = K > 0 ? x.numel() / K : 0;
    const int64_t stride = fd_amx::padded_groups(K2);
    const uint32_t* xb = pair_rows(x, M, K, K2, fd_amx::padded_rows(M), stride);
    const Problem p{xb, static_cast<const uint8_t*>(weight.data()), nullptr, M, K2, N};
    auto* y = static_cast<uint16_t*>(out.data());
    fd_amx::on_tiles(path == kAmx, [&](auto tiles) { gate_up_silu_amx<decltype(tiles)>(p, stride, y); });
  });
  return {out};
}

// 1 when this CPU runs the dot path (AVX-512 BF16), else 0.
std::vector<paddle::Tensor> Bf16DotAvailable(const paddle::Tensor& unused) {
  auto out = paddle::empty({1}, paddle::DataType::INT64, paddle::CPUPlace());
  out.data<int64_t>()[0] = cpu_has_bf16_dot() ? 1 : 0;
  return {out};
}

std::vector<std::vector<int64_t>> Bf16Shape(const std::vector<int64_t>& x, const std::vector<int64_t>& w) {
  return {out_shape(x, w[0] * kCols)};
}

std::vector<paddle::DataType> Bf16Dtype(const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(fd_bf16_linear)
    .Inputs({"X", "Weight"})
    .Outputs({"Out"})
    .Attrs({"path: int64_t"})
    .SetKernelFn(PD_KERNEL(Bf16Linear))
    .SetInferShapeFn(PD_INFER_SHAPE(Bf16Shape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Bf16Dtype));

// The amx path's state in this process: 0 no AMX-BF16 (or the OS refused the tile state), 1 the
// auto path uses tiles, 2 the tiles failed the self-check and the auto path does not use them.
// The self-check's own tests: model = 1 runs it on the tile model, model = 2 on tiles that fault
// (each 1 when it passes, else 2).
std::vector<paddle::Tensor> Bf16AmxState(const paddle::Tensor& unused, int64_t model) {
  PD_CHECK(model >= 0 && model <= 2, "model must be 0 (this process's state), 1 (the check on the tile model) or 2 "
           "(the check on faulting tiles), got ", model);
  auto out = paddle::empty({1}, paddle::DataType::INT64, paddle::CPUPlace());
  out.data<int64_t>()[0] = model == 0   ? amx_state()
                           : model == 1 ? fd_amx::check_state(tiles_agree<fd_amx::ModelTiles>)
                                        : fd_amx::check_state(tiles_agree<FaultingTiles>);
  return {out};
}

PD_BUILD_OP(fd_bf16_amx_state)
    .Inputs({"Unused"})
    .Outputs({"State"})
    .Attrs({"model: int64_t"})
    .SetKernelFn(PD_KERNEL(Bf16AmxState));

PD_BUILD_OP(fd_bf16_dot_available)
    .Inputs({"Unused"})
    .Outputs({"Available"})
    .SetKernelFn(PD_KERNEL(Bf16DotAvailable));

std::vector<std::vector<int64_t>> Bf16SiluShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w) {
  return {out_shape(x, w[0] * kCols / 2)};
}

std::vector<paddle::DataType> Bf16SiluDtype(const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::BFLOAT16};
}

PD_BUILD_OP(fd_bf16_linear_silu)
    .Inputs({"X", "Weight"})
    .Outputs({"Out"})
    .Attrs({"path: int64_t"})
    .SetKernelFn(PD_KERNEL(Bf16LinearSilu))
    .SetInferShapeFn(PD_INFER_SHAPE(Bf16SiluShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Bf16SiluDtype));

// Each row's argmax of x W (first index on ties, NaN as -inf: fd_argmax of fd_bf16_linear's
// output, the same tokens) through AMX tiles, without the logits: `path` 3 the instructions, 4
// their software model. int64 [M].
std::vector<paddle::Tensor> Bf16LinearArgmax(const paddle::Tensor& x_in, const paddle::Tensor& weight, int64_t path) {
  PD_CHECK(x_in.shape().size() == 2, "x must be [M, K]");
  const Shape shape = checked_inputs(x_in, weight, path, true);
  const int64_t K = shape.K, K2 = shape.K2, N = shape.N, M = x_in.shape()[0];
  PD_CHECK(N < (int64_t{1} << 31), "more than 2^31 columns");
  auto out = paddle::empty({M}, paddle::DataType::INT64, paddle::CPUPlace());
  const paddle::Tensor x = x_in.contiguous();
  const int64_t stride = fd_amx::padded_groups(K2);
  const uint32_t* xb = pair_rows(x, M, K, K2, fd_amx::padded_rows(M), stride);
  const Problem p{xb, static_cast<const uint8_t*>(weight.data()), nullptr, M, K2, N};
  if (M > 0)
    fd_amx::on_tiles(path == kAmx, [&](auto tiles) { argmax_amx<decltype(tiles)>(p, stride, out.data<int64_t>()); });
  return {out};
}

PD_BUILD_OP(fd_bf16_linear_argmax)
    .Inputs({"X", "Weight"})
    .Outputs({"Tokens"})
    .Attrs({"path: int64_t"})
    .SetKernelFn(PD_KERNEL(Bf16LinearArgmax));
