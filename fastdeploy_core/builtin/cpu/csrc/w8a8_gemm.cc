// Linear layers with int8 weights (one scale per output channel) multiplied as integers by the
// rows of x rounded per row: --quantization w8a8 (one int8 piece) and wint8 (two int8 pieces,
// 16-bit activations).
//
//   pieces 1 (w8a8): xq[m, k] = round(clamp(x[m, k] / xs[m], -127, 127)), xs[m] = max_k |x[m, k]| / 127
//              (1 for a zero row); round to nearest, ties to even (paddle.round), the division float32;
//              y[m, n] = (float(sum_k xq[m, k] q[k, n]) * ws[n]) * xs[m], the sum exact in int32.
//   pieces 2 (wint8): a[m, k] = round(clamp(x[m, k] / xs[m], -32639, 32639)), xs[m] = max_k |x| / 32639,
//              split a = 256 hi + lo (hi = (a + 128) >> 8 in [-127, 127], lo in [-128, 127]);
//              y[m, n] = (fma(float(sum_k hi q), 256, float(sum_k lo q)) * ws[n]) * xs[m], each sum
//              exact in int32. Each row's rounding depends on that row alone, so a request's
//              outputs do not depend on the rows batched with it; the activations' relative error
//              is at most 1/65278 of the row's largest value (wint8's weights: 1/254 of a column's).
//
// The integer sums are exact, so the result is one rounding of each to float32 and a few float
// operations: tests compare it bit for bit with that formula. The float32 reference formulas
// (weight_only.int8_linear_reference) sum the products in float32 instead; pieces 2 also
// differs from wint8's formula by the activations' rounding.
//
// Layout. q is int8 [N / 32, K / 4, 32, 4]: element (t, c, n, j) is q[4 c + j, 32 t + n], so a
// 64-byte load is 16 columns x 4 consecutive k, one column per 32-bit lane, as vpdpbusd takes
// them; a tile's 32 columns are one contiguous stream over K. Codes are in [-127, 127] (the
// layout is only used when they are).
//
// Integer products (int8_dot.h's dot_u8): vpdpbusd multiplies unsigned by signed bytes, so each
// weight vector is flipped to q + 128 (xor 0x80) and the row's activations are the signed
// operand: the sum is then sum q xq + 128 sum xq, and 128 sum_k xq[m, k] (computed while the row
// is rounded) is taken off. AVX2 (vpmaddubsw + vpmaddwd, int8_dot.h) computes sum q xq directly.
// Without either (no FD_INT8_DOT) a scalar loop computes the same integers.
//
// AMX-INT8 (tdpbssd, amx_tiles.h): the quad layout is the B tiles' layout, and the rows' codes
// (signed, no flip) are A tiles of 16 rows x 16 quads, zero-padded. The same exact integer sums
// in another order, so the same bits: tests compare every path with the formula bit for bit.
// The auto path takes tiles for calls of 16 rows or more (a full A tile; a decode row would use
// one of a tile's 16 rows, and few rows are bound by the weights' stream either way) once the OS
// granted the tile state and the tiles reproduced the exact sums of a small problem. A software
// model of the instructions runs the same loop on any CPU (path 3, for tests of machines
// without AMX).
// `path`: 0 = the CPU's best, 1 = vector (VNNI, AVX2 or scalar), 2 = amx (an error without
// AMX-INT8), 3 = the amx loop on the tile model.
//
// Threads claim (panel of 64 rows, one or two column tiles) items and each tile runs the panel's
// rows in register blocks (row_panels.h, as fd_bf16_linear's do); the amx path's items are groups
// of tiles a block of 32 rows at a time (run_blocks).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "graph.h"
#include "int8_dot.h"
#include "paddle/extension.h"
#include "row_panels.h"
#include "tile_argmax.h"
#include "vector_math.h"

namespace {

constexpr int64_t kCols = 32;                 // output columns per tile
constexpr int64_t kQuad = 4;                  // k per 32-bit lane
constexpr int64_t kQuadBytes = kCols * kQuad;  // one quad of k of one tile: 128 bytes
constexpr int64_t kPrefetchBytes = 2048;      // how far ahead a few-row tile asks for weights
using fd_int8_pieces::kPieceMax;  // two pieces: |a| bound, a = 256 hi + lo with hi, lo int8

// The largest code of a row rounded to `pieces` int8 pieces.
inline float max_code(int pieces) { return pieces == 1 ? 127.f : static_cast<float>(kPieceMax); }

// The rows of x as int8 pieces, their scales and what each piece's integer sums carry beyond
// sum q piece (128 * the sum of the row's piece where the weights are flipped, see above).
struct Rows {
  fd_amx::TileBuffer<int8_t> q;  // [pieces, rows, stride]: the codes (one piece), or the high then the low pieces
  std::vector<float> scale;  // [M]
  std::vector<int32_t> bias; // [pieces, M]
  int64_t rows = 0, stride = 0;  // M and K, or for tiles rounded up to whole tiles (zero past x)
};

#if defined(FD_INT8_DOT)
using namespace fd_int8_dot;
constexpr int32_t kFlipBias = kDotU8Centred ? 0 : 128;
#else
constexpr int32_t kFlipBias = 0;
#endif

// One code's pieces: the code itself, or hi and lo (fd_int8_pieces).
inline void split_code(int a, int pieces, int8_t* hi, int8_t* lo, int32_t* sum_hi, int32_t* sum_lo) {
  if (pieces == 1) {
    *hi = static_cast<int8_t>(a);
    *sum_hi += a;
    return;
  }
  const int h = fd_int8_pieces::high_piece(a);
  *hi = static_cast<int8_t>(h);
  *lo = static_cast<int8_t>(a - 256 * h);
  *sum_hi += h;
  *sum_lo += a - 256 * h;
}

// Rows [m_begin, m_end) of x rounded into out (quantize_rows laid it out).
void quantize_row_range(const float* x, int64_t m_begin, int64_t m_end, int64_t M, int64_t K, int pieces, Rows* out) {
  const float top = max_code(pieces);
  for (int64_t m = m_begin; m < m_end; ++m) {
    const float* xr = x + m * K;
    int8_t* hr = out->q.data() + m * out->stride;
    int8_t* lr = out->q.data() + (out->rows + m) * out->stride;  // the low pieces (two pieces only)
    float amax = 0.f;
    int64_t k = 0;
#if defined(FD_INT8_DOT)
    F32 vmax = zero_f();
    for (; k + 16 <= K; k += 16) vmax = max_f(vmax, abs_f(load_f(xr + k)));
    amax = reduce_max_f(vmax);
#endif
    for (; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    const float s = amax > 0.f ? amax / top : 1.f;
    out->scale[m] = s;
    int32_t sum_hi = 0, sum_lo = 0;
    k = 0;
#if defined(FD_INT8_DOT)
    const F32 vs = set1_f(s), hi = set1_f(top), lo = set1_f(-top);
    I32 vsum_hi = zero_i(), vsum_lo = zero_i();
    for (; k + 16 <= K; k += 16) {
      // Clamped first (|v| may pass the top code by a rounding of the scale), then rounded to
      // nearest even by the conversion, as paddle.round and std::nearbyint.
      const I32 qi = round_i(min_f(hi, max_f(lo, div_f(load_f(xr + k), vs))));
      if (pieces == 1) {
        vsum_hi = add_i(vsum_hi, qi);
        store_bytes(hr + k, qi);
      } else {
        const I32 h = high_piece(qi), l = low_piece(qi, h);
        vsum_hi = add_i(vsum_hi, h);
        vsum_lo = add_i(vsum_lo, l);
        store_bytes(hr + k, h);
        store_bytes(lr + k, l);
      }
    }
    sum_hi = reduce_add_i(vsum_hi);
    sum_lo = reduce_add_i(vsum_lo);
#endif
    for (; k < K; ++k) {
      const int a = static_cast<int>(std::nearbyint(std::min(top, std::max(-top, xr[k] / s))));
      split_code(a, pieces, hr + k, lr + k, &sum_hi, &sum_lo);
    }
    out->bias[m] = kFlipBias * sum_hi;
    if (pieces == 2) out->bias[M + m] = kFlipBias * sum_lo;
    if (out->stride > K) {  // the tiles' zero quads past K
      std::fill(hr + K, hr + out->stride, int8_t{0});
      if (pieces == 2) std::fill(lr + K, lr + out->stride, int8_t{0});
    }
  }
}

// tiles: lay the codes out as A tiles read them (fd_amx: rows and quads rounded up to 16, zeros).
// out is reused from call to call (the caller's thread keeps it), so a call neither allocates nor
// zero-fills it whole; the pool's threads round 16-row chunks side by side.
void quantize_rows(const float* x, int64_t M, int64_t K, int pieces, bool tiles, Rows* out) {
  out->rows = tiles ? fd_amx::padded_rows(M) : M;
  out->stride = tiles ? fd_amx::padded_groups(K / kQuad) * kQuad : K;
  const size_t size = static_cast<size_t>(pieces * out->rows * out->stride);
  if (out->q.size() < size) out->q.resize(size);
  out->scale.resize(M);
  out->bias.resize(pieces * M);
  for (int piece = 0; piece < pieces; ++piece) {  // the tiles' zero rows past M
    int8_t* q = out->q.data() + (piece * out->rows) * out->stride;
    std::fill(q + M * out->stride, q + out->rows * out->stride, int8_t{0});
  }
  fd_kernels::run_row_chunks<16>(M, [=](int64_t m0, int64_t m1) { quantize_row_range(x, m0, m1, M, K, pieces, out); });
}

struct Problem {
  const int8_t* xq;     // [pieces, x_rows, x_stride]
  const int32_t* bias;  // [pieces, M]
  const float* xs;      // [M]
  const int8_t* w;      // [N / 32, K / 4, 32, 4]
  const float* ws;      // [N]
  float* y;             // [M, N]
  int64_t M, K, N;
  int64_t x_rows, x_stride;  // Rows::rows, Rows::stride
};

#if defined(FD_INT8_DOT)
// Rows per register block: 8 rows x 2 vectors of int32 sums in zmm registers (16 of 32), or 2
// rows of AVX2 register pairs (8 of 16 ymm, the rest for the weights and vpmaddubsw's operands);
// half as many with two pieces (a sum per piece).
template <int PIECES>
constexpr int kBlock = (FD_INT8_DOT == 512 ? 8 : 2) / PIECES;

template <int ROWS, int PIECES>
void tile(const Problem& p, int64_t m, int64_t t) {
  const int8_t* wt = p.w + t * (p.K / kQuad) * kQuadBytes;
  const I32 flip = set1_i(static_cast<int32_t>(0x80808080u));
  I32 acc[ROWS][PIECES][2];
  for (int r = 0; r < ROWS; ++r)
    for (int q = 0; q < PIECES; ++q) acc[r][q][0] = acc[r][q][1] = zero_i();
  const int64_t piece_stride = p.x_rows * p.x_stride;
  const int8_t* xr = p.xq + m * p.x_stride;
  for (int64_t c = 0; c < p.K / kQuad; ++c) {
    const int8_t* src = wt + c * kQuadBytes;
    if (ROWS <= 2) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes), _MM_HINT_T0);
    if (ROWS <= 2) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes + 64), _MM_HINT_T0);
    const I32 u0 = xor_i(load_i(src), flip), u1 = xor_i(load_i(src + 64), flip);
    for (int r = 0; r < ROWS; ++r)
      for (int q = 0; q < PIECES; ++q) {
        int32_t four;
        std::memcpy(&four, xr + q * piece_stride + r * p.x_stride + c * kQuad, 4);
        const I32 xv = set1_i(four);
        acc[r][q][0] = dot_u8(acc[r][q][0], u0, xv);
        acc[r][q][1] = dot_u8(acc[r][q][1], u1, xv);
      }
  }
  const float* ws = p.ws + t * kCols;
  const F32 ws0 = load_f(ws), ws1 = load_f(ws + 16);
  for (int r = 0; r < ROWS; ++r) {
    const F32 xs = set1_f(p.xs[m + r]);
    F32 v[2];
    for (int h = 0; h < 2; ++h) {
      v[h] = to_f(sub_i(acc[r][0][h], set1_i(p.bias[m + r])));
      if constexpr (PIECES == 2)
        v[h] = fmadd(v[h], set1_f(256.f), to_f(sub_i(acc[r][1][h], set1_i(p.bias[p.M + m + r]))));
    }
    float* yr = p.y + (m + r) * p.N + t * kCols;
    store_f(yr, mul_f(mul_f(v[0], ws0), xs));
    store_f(yr + 16, mul_f(mul_f(v[1], ws1), xs));
  }
}

template <int PIECES>
void gemm(const Problem& p) {
  fd_kernels::run_row_panels(p.M, p.N / kCols, [&p](int64_t t, int64_t m_begin, int64_t m_end) {
    fd_kernels::row_blocks<kBlock<PIECES>>(m_begin, m_end,
                                           [&](auto rows, int64_t m) { tile<decltype(rows)::value, PIECES>(p, m, t); });
  });
}
#else
// The same integers without integer dot products.
template <int PIECES>
void gemm(const Problem& p) {
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = 0; n < p.N; ++n) {
      const int8_t* wt = p.w + (n / kCols) * (p.K / kQuad) * kQuadBytes + (n % kCols) * kQuad;
      int32_t sum[2] = {0, 0};
      for (int q = 0; q < PIECES; ++q)
        for (int64_t k = 0; k < p.K; ++k)
          sum[q] += p.xq[(q * p.x_rows + m) * p.x_stride + k] * wt[(k / kQuad) * kQuadBytes + k % kQuad];
      float v = static_cast<float>(sum[0]);
      if (PIECES == 2) v = std::fma(v, 256.f, static_cast<float>(sum[1]));
      p.y[m * p.N + n] = (v * p.ws[n]) * p.xs[m];
    }
}
#endif

enum Path : int64_t { kAuto = 0, kVector = 1, kAmx = 2, kAmxModel = 3 };
constexpr int64_t kAmxMinRows = fd_amx::kTileRows;  // the auto path's tiles: calls of a full A tile or more

// The amx path's outputs of tile t for the block of `rows` (<= 32) rows from m into out (row m + r
// at out + r * out_stride): the rows through tiles, piece by piece (quantize_rows laid the codes
// out for tiles); the sums of two pieces meet in the same epilogue as the vector path's
// (float(hi) * 256 + float(lo), fused). The caller holds a TileScope.
template <class Tiles, int PIECES>
void block_outputs(const Problem& p, int64_t t, int64_t m, int64_t rows, float* out, int64_t out_stride) {
  const int64_t a_stride = p.x_stride / kQuad, quads = p.K / kQuad;
  const auto* wt = reinterpret_cast<const uint8_t*>(p.w + t * quads * kQuadBytes);
  const float* ws = p.ws + t * kCols;
  alignas(64) int32_t sums[PIECES][fd_amx::kBlockRows][kCols];
  fd_amx::PaddedTile tile(nullptr, a_stride, wt, quads);
  for (int q = 0; q < PIECES; ++q) {
    tile.op.a = reinterpret_cast<const uint32_t*>(p.xq + q * p.x_rows * p.x_stride) + m * a_stride;
    fd_amx::tile_block_rows<Tiles>(fd_amx::Kind::kInt8, tile.op, rows, reinterpret_cast<uint8_t*>(&sums[q][0][0]),
                                   kCols * 4, false);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = out + r * out_stride;
    const float xs = p.xs[m + r];
    for (int64_t n = 0; n < kCols; ++n) {
      float v = static_cast<float>(sums[PIECES - 1][r][n]);
      if constexpr (PIECES == 2) v = std::fma(static_cast<float>(sums[0][r][n]), 256.f, v);
      yr[n] = (v * ws[n]) * xs;
    }
  }
}

// block(m, rows, t) for each block of 32 rows across groups of tiles (fd_amx::run_tile_blocks,
// as fd_bf16_linear's amx loops), panels sized for the codes of PIECES pieces.
template <class Tiles, int PIECES, class Block>
void run_blocks(const Problem& p, int64_t tiles, const Block& block) {
  fd_amx::run_tile_blocks<Tiles>(p.M, tiles, fd_kernels::panel_rows_for(PIECES * p.x_stride), block);
}

template <class Tiles, int PIECES>
void gemm_amx(const Problem& p) {
  run_blocks<Tiles, PIECES>(p, p.N / kCols, [&p](int64_t m, int64_t rows, int64_t t) {
    block_outputs<Tiles, PIECES>(p, t, m, rows, p.y + m * p.N + t * kCols, p.N);
  });
}

// fd_w8a8_linear_silu's loop: p.y [M, N / 2] = silu(gate) * up of the product's halves (columns
// [0, N / 2) and [N / 2, N)): for each block of rows, gate tile t and up tile t + N / 64 into two
// L1 buffers, then fd_silu_mul's formula into y, so the [M, N] product never goes through memory.
// The same bits as fd_w8a8_linear (any path: exact integer sums) and then fd_silu_mul.
template <class Tiles, int PIECES>
void gate_up_silu_amx(const Problem& p) {
  const int64_t half = p.N / kCols / 2, I = p.N / 2;
  run_blocks<Tiles, PIECES>(p, half, [&](int64_t m, int64_t rows, int64_t t) {
    alignas(64) float gate[fd_amx::kBlockRows][kCols], up[fd_amx::kBlockRows][kCols];
    block_outputs<Tiles, PIECES>(p, t, m, rows, &gate[0][0], kCols);
    block_outputs<Tiles, PIECES>(p, t + half, m, rows, &up[0][0], kCols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < kCols; h += 16)
        fd_kernels::store16(p.y + (m + r) * I + t * kCols + h,
                            fd_kernels::silu_mul16(fd_kernels::load16(gate[r] + h), fd_kernels::load16(up[r] + h)));
  });
}

// fd_w8a8_linear_argmax's loop: each row's argmax of the product (tile_argmax.h: fd_argmax's
// rule) from each block's outputs in an L1 buffer, without the [M, N] output going through
// memory (a w8a8 LM head's greedy tokens).
template <class Tiles, int PIECES>
void argmax_amx(const Problem& p, int64_t* out) {
  const int64_t tiles = p.N / kCols;
  static_assert(kCols == 32, "TileBest takes 32-column tiles");
  fd_kernels::TileBest best(p.M, tiles);
  run_blocks<Tiles, PIECES>(p, tiles, [&](int64_t m, int64_t rows, int64_t t) {
    alignas(64) float values[fd_amx::kBlockRows][kCols];
    block_outputs<Tiles, PIECES>(p, t, m, rows, &values[0][0], kCols);
    best.put(t, m, rows, values[0], kCols);
  });
  best.argmax(kCols, out);
}

// The tiles' sums of a small problem (20 rows: a tile and a part; K = 80: a tile of 16 quads and
// a tail of 4) against the exact integer sums (fd_amx::checked_state runs it in a forked child).
template <class Tiles>
bool tiles_sum_exactly() {
  constexpr int64_t M = 20, K = 80, N = 32;
  const int64_t stride = fd_amx::padded_groups(K / kQuad);
  std::vector<int8_t> x(M * K), w(N * K);  // w packed: [K / 4, 32, 4]
  uint32_t seed = 777u;
  for (auto* v : {&x, &w})
    for (int8_t& e : *v) e = static_cast<int8_t>(static_cast<int>((seed = seed * 1664525u + 1013904223u) >> 24) % 255 - 127);
  fd_amx::TileBuffer<uint32_t> a(fd_amx::padded_rows(M) * stride, 0u);
  for (int64_t m = 0; m < M; ++m) std::memcpy(a.data() + m * stride, x.data() + m * K, K);
  bool exact = true;
  const auto* wb = reinterpret_cast<const uint8_t*>(w.data());
  fd_amx::group_blocks<Tiles>(0, 1, 0, M, [&](int64_t m, int64_t n_rows, int64_t) {
    alignas(64) int32_t out[fd_amx::kBlockRows][fd_amx::kTileCols];
    const fd_amx::PaddedTile tile(a.data() + m * stride, stride, wb, K / kQuad);
    fd_amx::tile_block_rows<Tiles>(fd_amx::Kind::kInt8, tile.op, n_rows, reinterpret_cast<uint8_t*>(&out[0][0]),
                                   fd_amx::kTileCols * 4, false);
    for (int64_t r = 0; r < n_rows; ++r)
      for (int64_t n = 0; n < N; ++n) {
        int32_t sum = 0;
        for (int64_t k = 0; k < K; ++k) sum += x[(m + r) * K + k] * w[(k / kQuad) * kQuadBytes + n * kQuad + k % kQuad];
        exact = exact && out[r][n] == sum;
      }
  });
  return exact;
}

// Whether the auto path takes AMX tiles (AMX-INT8 granted by the OS, self-check passed).
fd_amx::State amx_state() {
#if defined(__x86_64__)
  static const fd_amx::State state = fd_amx::checked_state(
      fd_amx::Kind::kInt8, tiles_sum_exactly<fd_amx::HardwareTiles>, "fd_w8a8_linear", "the vector path");
  return state;
#else
  return fd_amx::kNoTiles;
#endif
}

// Which loop a call of M rows takes: the vector loop, the tiles or the tile model.
Path path_for(int64_t path, int64_t M) {
  if (path == kAuto) return M >= kAmxMinRows && amx_state() == fd_amx::kTilesInUse ? kAmx : kVector;
  return static_cast<Path>(path);
}

template <int PIECES>
void gemm_on(const Problem& p, Path path) {
  if (path == kAmx || path == kAmxModel)
    return fd_amx::on_tiles(path == kAmx, [&](auto tiles) { gemm_amx<decltype(tiles), PIECES>(p); });
  gemm<PIECES>(p);
}

// f(tiles, pieces) for an amx path (2: the instructions, else their model) and 1 or 2 pieces,
// both as types (pieces a std::integral_constant): the fused kernels' dispatch.
template <class F>
void on_tiles_and_pieces(int64_t path, int64_t pieces, const F& f) {
  fd_amx::on_tiles(path == kAmx, [&](auto tiles) {
    if (pieces == 1) f(tiles, std::integral_constant<int, 1>{});
    else f(tiles, std::integral_constant<int, 2>{});
  });
}

std::vector<int64_t> out_shape(const std::vector<int64_t>& x_shape, int64_t n) {
  std::vector<int64_t> shape(x_shape.begin(), x_shape.end() - 1);
  shape.push_back(n);
  return shape;
}

// The checks every fd_w8a8_linear op makes of its inputs (the fused ones, `tiles_only`, take
// path 2 or 3 only): {K, N}.
std::pair<int64_t, int64_t> checked_inputs(const paddle::Tensor& x, const paddle::Tensor& weight,
                                           const paddle::Tensor& scale, int64_t pieces, int64_t path, bool tiles_only) {
  PD_CHECK(pieces == 1 || pieces == 2, "pieces must be 1 (int8 activations) or 2 (16-bit), got ", pieces);
  if (tiles_only)
    PD_CHECK(path == kAmx || path == kAmxModel, "path must be 2 (amx) or 3 (amx on the tile model), got ", path);
  else
    PD_CHECK(path >= kAuto && path <= kAmxModel,
             "path must be 0 (auto), 1 (vector), 2 (amx) or 3 (amx on the tile model), got ", path);
  PD_CHECK(path != kAmx || fd_amx::amx_permitted(fd_amx::Kind::kInt8),
           "the amx path needs AMX-INT8 tiles granted by the OS, which this CPU or kernel does not have");
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, "x must be float32");
  PD_CHECK(weight.dtype() == paddle::DataType::INT8, "weight must be int8");
  const auto& ws = weight.shape();
  PD_CHECK(ws.size() == 4 && ws[2] == kCols && ws[3] == kQuad, "weight must be packed [N / 32, K / 4, 32, 4]");
  const int64_t K = ws[1] * kQuad, N = ws[0] * kCols;
  PD_CHECK(!x.shape().empty() && x.shape().back() == K, "x's last axis (", x.shape().empty() ? 0 : x.shape().back(),
           ") must equal the weight's K (", K, ")");
  PD_CHECK(scale.dtype() == paddle::DataType::FLOAT32 && scale.numel() == N,
           "scale must be float32 with one value per output channel (", N, ")");
  return {K, N};
}

}  // namespace

std::vector<paddle::Tensor> W8a8Linear(const paddle::Tensor& x_in, const paddle::Tensor& weight,
                                       const paddle::Tensor& scale, int64_t pieces, int64_t path) {
  const std::pair<int64_t, int64_t> kn = checked_inputs(x_in, weight, scale, pieces, path, false);
  const int64_t K = kn.first, N = kn.second;
  auto out = fd_graph::empty(out_shape(x_in.shape(), N), paddle::DataType::FLOAT32);
  fd_graph::run("fd_w8a8_linear", {&x_in, &weight, &scale}, {&out}, [=]() mutable {
    const paddle::Tensor x = x_in.contiguous();
    const int64_t M = K > 0 ? x.numel() / K : 0;
    const Path loop = path_for(path, M);
    thread_local Rows rows;
    quantize_rows(x.data<float>(), M, K, static_cast<int>(pieces), loop != kVector, &rows);
    const Problem p{rows.q.data(), rows.bias.data(), rows.scale.data(), static_cast<const int8_t*>(weight.data()),
                    scale.data<float>(), out.data<float>(), M, K, N, rows.rows, rows.stride};
    if (M > 0 && pieces == 1) gemm_on<1>(p, loop);
    if (M > 0 && pieces == 2) gemm_on<2>(p, loop);
  });
  return {out};
}

// silu(gate) * up of the linear's two output halves (SwiGLU on a merged gate/up projection) on
// AMX-INT8 tiles: `path` 2 the instructions (an error without them), 3 their software model.
// fd_w8a8_linear with the same pieces followed by fd_silu_mul gives the same bits.
std::vector<paddle::Tensor> W8a8LinearSilu(const paddle::Tensor& x_in, const paddle::Tensor& weight,
                                           const paddle::Tensor& scale, int64_t pieces, int64_t path) {
  const std::pair<int64_t, int64_t> kn = checked_inputs(x_in, weight, scale, pieces, path, true);
  const int64_t K = kn.first, N = kn.second;
  PD_CHECK(N % (2 * kCols) == 0, "the gate and up halves must be whole tiles of 32 columns each (N = ", N,
           " is not a multiple of 64)");
  auto out = fd_graph::empty(out_shape(x_in.shape(), N / 2), paddle::DataType::FLOAT32);
  fd_graph::run("fd_w8a8_linear_silu", {&x_in, &weight, &scale}, {&out}, [=]() mutable {
    const paddle::Tensor x = x_in.contiguous();
    const int64_t M = K > 0 ? x.numel() / K : 0;
    thread_local Rows rows;
    quantize_rows(x.data<float>(), M, K, static_cast<int>(pieces), true, &rows);
    const Problem p{rows.q.data(), rows.bias.data(), rows.scale.data(), static_cast<const int8_t*>(weight.data()),
                    scale.data<float>(), out.data<float>(), M, K, N, rows.rows, rows.stride};
    if (M == 0) return;
    on_tiles_and_pieces(path, pieces, [&](auto tiles, auto n) { gate_up_silu_amx<decltype(tiles), decltype(n)::value>(p); });
  });
  return {out};
}

std::vector<std::vector<int64_t>> W8a8Shape(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                            const std::vector<int64_t>&) {
  return {out_shape(x, w[0] * kCols)};
}

std::vector<paddle::DataType> W8a8Dtype(const paddle::DataType&, const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(fd_w8a8_linear)
    .Inputs({"X", "Weight", "Scale"})
    .Outputs({"Out"})
    .Attrs({"pieces: int64_t", "path: int64_t"})
    .SetKernelFn(PD_KERNEL(W8a8Linear))
    .SetInferShapeFn(PD_INFER_SHAPE(W8a8Shape))
    .SetInferDtypeFn(PD_INFER_DTYPE(W8a8Dtype));

// fd_w8a8_linear's tiles in this process: 0 no AMX-INT8 (or the OS refused the tile state), 1 the
// auto path uses them, 2 they failed the self-check. model = 1 runs the self-check on the tile
// model instead (1 it passes, 2 not): the check's own test.
std::vector<paddle::Tensor> W8a8AmxState(const paddle::Tensor& unused, int64_t model) {
  PD_CHECK(model == 0 || model == 1, "model must be 0 (this process's state) or 1 (the check on the tile model), got ",
           model);
  auto out = paddle::empty({1}, paddle::DataType::INT64, paddle::CPUPlace());
  out.data<int64_t>()[0] = model == 0 ? amx_state() : fd_amx::check_state(tiles_sum_exactly<fd_amx::ModelTiles>);
  return {out};
}

PD_BUILD_OP(fd_w8a8_amx_state)
    .Inputs({"Unused"})
    .Outputs({"State"})
    .Attrs({"model: int64_t"})
    .SetKernelFn(PD_KERNEL(W8a8AmxState));

std::vector<std::vector<int64_t>> W8a8SiluShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                                const std::vector<int64_t>&) {
  return {out_shape(x, w[0] * kCols / 2)};
}

PD_BUILD_OP(fd_w8a8_linear_silu)
    .Inputs({"X", "Weight", "Scale"})
    .Outputs({"Out"})
    .Attrs({"pieces: int64_t", "path: int64_t"})
    .SetKernelFn(PD_KERNEL(W8a8LinearSilu))
    .SetInferShapeFn(PD_INFER_SHAPE(W8a8SiluShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(W8a8Dtype));

// Each row's argmax of fd_w8a8_linear's output (first index on ties, NaN as -inf: fd_argmax's
// rule, the same tokens) on AMX-INT8 tiles, without the output: `path` 2 the instructions, 3
// their software model. int64 [M].
std::vector<paddle::Tensor> W8a8LinearArgmax(const paddle::Tensor& x_in, const paddle::Tensor& weight,
                                             const paddle::Tensor& scale, int64_t pieces, int64_t path) {
  PD_CHECK(x_in.shape().size() == 2, "x must be float32 [M, K]");
  const std::pair<int64_t, int64_t> kn = checked_inputs(x_in, weight, scale, pieces, path, true);
  const int64_t K = kn.first, N = kn.second;
  const int64_t M = x_in.shape()[0];
  PD_CHECK(N < (int64_t{1} << 31), "more than 2^31 columns");
  auto out = paddle::empty({M}, paddle::DataType::INT64, paddle::CPUPlace());
  const paddle::Tensor x = x_in.contiguous();
  thread_local Rows rows;
  quantize_rows(x.data<float>(), M, K, static_cast<int>(pieces), true, &rows);
  const Problem p{rows.q.data(), rows.bias.data(), rows.scale.data(), static_cast<const int8_t*>(weight.data()),
                  scale.data<float>(), nullptr, M, K, N, rows.rows, rows.stride};
  int64_t* tokens = out.data<int64_t>();
  if (M > 0)
    on_tiles_and_pieces(path, pieces, [&](auto tiles, auto n) { argmax_amx<decltype(tiles), decltype(n)::value>(p, tokens); });
  return {out};
}

PD_BUILD_OP(fd_w8a8_linear_argmax)
    .Inputs({"X", "Weight", "Scale"})
    .Outputs({"Tokens"})
    .Attrs({"pieces: int64_t", "path: int64_t"})
    .SetKernelFn(PD_KERNEL(W8a8LinearArgmax));
