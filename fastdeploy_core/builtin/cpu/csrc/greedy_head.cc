// Greedy tokens from the float32 LM head without computing every logit in float32.
//
//   fd_greedy_head(hidden [B, K], weight [V / 32, K, 32], screen, meta) -> (tokens int64 [B],
//                                                                          tiles int64 [B])
// returns exactly fd_argmax(fd_f32_linear(hidden, weight)) (first index on ties, NaN as -inf);
// tiles[b] is how many 32-column tiles row b recomputed in float32 (V / 32: the whole row).
//   fd_greedy_head_prepare(weight [V / 32, K, 32]) -> (screen uint8 [V / 32, ceil(K / 4), 32, 4],
//                                                     meta float32 [V / 32, 3, 32])
// builds the int8 screen copy once per model (the cpu ops call it after loading).
//
// Greedy decoding needs only each row's argmax, and the LM head is the widest product of a step
// (SmolLM2-135M: 576 x 49152, 113 MB of float32, ~21% of a batch-64 decode step). Three passes:
//
// 1. Screen. Each vocabulary row i (a weight column) is kept as int8 codes q_i with one
//    symmetric scale s_i = max|w_i| / 127, stored as q + 128 (uint8) in the int4 VNNI kernel's
//    tile layout: 32 columns x 4 consecutive k per 128 bytes, what vpdpbusd (u8 x s8, 4 products
//    per int32 lane) multiplies. Each hidden row x is rounded to int8 codes per row in two
//    parts: its 16 largest |x_k| (outlier channels) with scale s_o = |x|max / 127, the other
//    channels with s_m = (their largest |x_k|) / 127. SmolLM2's final hidden states have such
//    outliers (|x|max 17-45 against an rms of 1.9); with one scale per row the bound below
//    admitted ~315 candidates per row on real decodes (some rows: all 49152). With the split,
//    ~12 tiles of 32 per row (16-bit codes everywhere, two int8 pieces as the int4 VNNI path:
//    ~5, for 2x the vpdpbusd; at batch 16-64 the screen is bound by them).
//    The approximate logit is a_i = s_i (s_m sum_k q p + s_o sum_k q o), p / o the main /
//    outlier codes; the outlier sum runs over the <= 16 chunks of 4 k that hold outliers. The
//    int32 dot products are exact (|q + 128| <= 255, |code| <= 127, K <= 65536).
// 2. Candidates. With x^ = s_m p + s_o o, e = x - x^, w^_i = s_i q_i, d_i = w_i - w^_i:
//       x . w_i = x^ . w^_i + x^ . d_i + e . w_i        (exact, real arithmetic)
//    so by Cauchy-Schwarz |x . w_i - a_i| <= |x^|_2 |d_i|_2 + |e|_2 |w_i|_2.
//    fd_f32_linear's float32 result f_i sums the K products in some order (one or two chains,
//    with or without fused multiply-adds): |f_i - x . w_i| <= gamma_{K+1} sum_k |x_k w_ik| +
//    (2 K + 2) 2^-126 (Higham's bound for recursive summation, gamma_n = n u / (1 - n u),
//    u = 2^-24, each term passing through at most K + 1 roundings; the absolute term: each of
//    the at most 2 K + 1 operations is off by less than 2^-126 more when its result underflows,
//    even flushed to zero), and sum_k |x_k w_ik| <= |x|_2 |w_i|_2. Hence
//       |f_i - a_i| <= E_i = A |d_i|_2 + B |w_i|_2 + C,
//       A = |x^|_2,  B = |e|_2 + gamma_{K+1} |x|_2,  C = (2 K + 2) 2^-126,
//    with A, B per hidden row (computed in double from the actual codes, rounded up), |d_i|_2
//    and |w_i|_2 per vocabulary row (prepare, in double, rounded up). The screen computes a_i
//    and E_i in float32 (a few roundings each: error < 2^-20 of E_i, and of |a_i|'s two parts
//    added without cancellation, |a|^) and widens E_i to E_i + 2^-16 (E_i + |a|^), which covers
//    those roundings and the ones of a_i +- E_i.
//    With L = max_j (a_j - E_j), every i with a_i + E_i < L has f_i < f_j for the j attaining
//    L, so it is neither the largest value nor tied with it: the argmax is among
//    {i : a_i + E_i >= L}. The screen keeps, per row and tile, the largest a_i + E_i and the
//    largest a_i - E_i; a tile is a candidate when its largest upper end reaches L.
// 3. Exact. Candidate tiles are recomputed with fd_f32_linear's own loop (f32_tiles.h) and the
//    same chain choice as the full call over these B rows, so every value is bit-identical to
//    the full path's; the argmax over them (tiles in ascending order, first index on ties) is
//    the full row's, since the full argmax is among them and every other value is smaller.
//    A row recomputes all its tiles (same loop) when its hidden state is not finite, when
//    |x|_2 max_i |w_i|_2 could overflow float32 (then NaN / inf could appear), or when more
//    than half of its tiles are candidates (a flat distribution: the rest costs less than 2x).
// The screen's integer products are int8_dot.h's dot_u8: vpdpbusd with AVX-512 VNNI, or with AVX2
// vpmaddubsw over |x| and the codes signed by x (the same integers). Without either every row
// takes the last path (correct, not faster; the cpu ops do not prepare a screen there).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "f32_tiles.h"
#include "int8_dot.h"
#include "line_buffer.h"
#include "paddle/extension.h"
#include "thread_pool.h"
#include "vector_math.h"

namespace {

constexpr int64_t kCols = fd_kernels::kTileColumns;  // vocabulary rows (weight columns) per tile
constexpr int64_t kChunkBytes = kCols * 4;  // one screen chunk: 32 columns x 4 k
constexpr int kOutliers = 16;               // largest |x_k| per row with their own int8 scale
constexpr int64_t kMaxK = 65536;            // K * 255 * 127 < 2^31: int32 dot products are exact
constexpr double kRoundUp = 1.0 + 1.0 / (1 << 20);  // covers double sums and the float cast
constexpr int kMetaRows = 3;                // meta per tile: s_i, |d_i|_2, |w_i|_2
constexpr int64_t kFullRowFraction = 2;     // more than 1/2 of the tiles as candidates: whole row
constexpr double kOverflowLimit = 0x1p124;  // |x|_2 max |w_i|_2 above this: whole row

using fd_kernels::ordered;  // fd_argmax's NaN rule

// ---- prepare --------------------------------------------------------------------------------------

struct PrepareJob {
  const float* w;  // [T, K, 32]
  int64_t K, Kc;
  uint8_t* screen;  // [T, Kc, 32, 4]
  float* meta;      // [T, 3, 32]
};

// One tile: per column, the scale, codes and the two norms (double sums, rounded up).
void prepare_tile(void* ctx, int64_t t) {
  const PrepareJob& j = *static_cast<const PrepareJob*>(ctx);
  const float* w = j.w + t * j.K * kCols;
  uint8_t* out = j.screen + t * j.Kc * kChunkBytes;
  float* meta = j.meta + t * kMetaRows * kCols;
  for (int64_t n = 0; n < kCols; ++n) {
    float amax = 0.f;
    for (int64_t k = 0; k < j.K; ++k) amax = std::max(amax, std::fabs(w[k * kCols + n]));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    double d2 = 0.0, w2 = 0.0;
    for (int64_t k = 0; k < j.Kc * 4; ++k) {
      int q = 0;
      if (k < j.K) {
        const double wk = w[k * kCols + n];
        q = static_cast<int>(std::max(-127.0, std::min(127.0, std::nearbyint(wk / s))));
        const double d = wk - static_cast<double>(s) * q;  // the residual the bound needs, not s / 2
        d2 += d * d;
        w2 += wk * wk;
      }
      out[(k / 4) * kChunkBytes + n * 4 + k % 4] = static_cast<uint8_t>(q + 128);
    }
    meta[n] = s;
    meta[kCols + n] = static_cast<float>(std::sqrt(d2) * kRoundUp);
    meta[2 * kCols + n] = static_cast<float>(std::sqrt(w2) * kRoundUp);
  }
}

// ---- per hidden row ---------------------------------------------------------------------------------

struct RowPlan {
  bool screened = false;  // false: recompute the whole row
  float sm = 1.f, so = 1.f;  // scales of the main and the outlier codes
  float A = 0.f, B = 0.f;    // the bound's coefficients
  int32_t sum_main = 0, sum_out = 0;
  int32_t num_chunks = 0;                 // how many chunks (of 4 k) hold outlier channels,
  int32_t chunks[kOutliers] = {};         // and which, ascending
};

// The magnitude below which a channel is "main": the (kOutliers + 1)-th largest |x_k| (0 when
// K <= kOutliers: every nonzero channel is an outlier).
float main_limit(const float* x, int64_t K) {
  if (K <= kOutliers) return 0.f;
  std::vector<float> mags(x, x + K);
  for (float& v : mags) v = std::fabs(v);
  std::nth_element(mags.begin(), mags.begin() + kOutliers, mags.end(), std::greater<float>());
  return mags[kOutliers];
}

// x's int8 codes (main and outlier, padded to Kc * 4 with zeros) and the bound's coefficients.
RowPlan plan_row(const float* x, int64_t K, int64_t Kc, float w2_max, int8_t* main, int8_t* out) {
  RowPlan plan;
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    if (!std::isfinite(x[k])) return plan;
    amax = std::max(amax, std::fabs(x[k]));
  }
  const float limit = main_limit(x, K);
  plan.sm = limit > 0.f ? limit / 127.f : 1.f;
  plan.so = amax > limit ? amax / 127.f : 1.f;
  double xh2 = 0.0, e2 = 0.0, x2 = 0.0;
  for (int64_t k = 0; k < Kc * 4; ++k) {
    int pm = 0, po = 0;
    if (k < K) {
      const double xk = x[k];
      const bool outlier = std::fabs(x[k]) > limit;
      const double scale = outlier ? plan.so : plan.sm;
      const int c = static_cast<int>(std::max(-127.0, std::min(127.0, std::nearbyint(xk / scale))));
      (outlier ? po : pm) = c;
      const double xh = scale * c, e = xk - xh;  // the bound uses these actual codes, whatever rounding gave them
      xh2 += xh * xh;
      e2 += e * e;
      x2 += xk * xk;
      if (outlier && (plan.num_chunks == 0 || plan.chunks[plan.num_chunks - 1] != k / 4))
        plan.chunks[plan.num_chunks++] = static_cast<int32_t>(k / 4);
    }
    main[k] = static_cast<int8_t>(pm);
    out[k] = static_cast<int8_t>(po);
    plan.sum_main += pm;
    plan.sum_out += po;
  }
  if (std::sqrt(x2) * w2_max > kOverflowLimit) return plan;
  constexpr double u = 1.0 / (1 << 24);
  const double gamma = (K + 1) * u / (1.0 - (K + 1) * u);
  plan.A = static_cast<float>(std::sqrt(xh2) * kRoundUp);
  plan.B = static_cast<float>((std::sqrt(e2) + gamma * std::sqrt(x2)) * kRoundUp);
  plan.screened = true;
  return plan;
}

// ---- screen -------------------------------------------------------------------------------------------

struct ScreenJob {
  const uint8_t* codes;  // [T, Kc, 32, 4]
  const float* meta;     // [T, 3, 32]
  int64_t T, Kc;
  float C;               // the bound's absolute term
  int64_t rows;          // screened rows
  const int8_t* main;    // [rows, Kc * 4] main codes
  const int8_t* out;     // [rows, Kc * 4] outlier codes (zero outside plan.chunks)
  const RowPlan* plan;   // [rows]
  float* upper;          // [rows, T]: per tile the largest a_i + E_i
  float* lower;          // [rows, T]: per tile the largest a_i - E_i
  int64_t per_item;      // tiles per work item
};

#if defined(FD_INT8_DOT)
using namespace fd_int8_dot;
constexpr bool kHaveInt8Dot = true;

inline I32 broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return set1_i(v);
}

// ROWS screened rows (from r0) against tile t: the int8 dot products, then a_i +- E_i.
template <int ROWS>
void screen_tile(const ScreenJob& j, int64_t r0, int64_t t) {
  const uint8_t* tile = j.codes + t * j.Kc * kChunkBytes;
  const int64_t Kp = j.Kc * 4;
  I32 acc[ROWS][2], acc_out[ROWS][2][2];
  for (int r = 0; r < ROWS; ++r)
    for (int h = 0; h < 2; ++h) acc[r][h] = acc_out[r][0][h] = acc_out[r][1][h] = zero_i();
  const uint8_t* w = tile;
  for (int64_t c = 0; c < j.Kc; ++c, w += kChunkBytes) {
    // One row streams the weights (batch-1 decode is bound by memory): ask 4 KB ahead, as the int4 VNNI loop.
    _mm_prefetch(reinterpret_cast<const char*>(w + 4096), _MM_HINT_NTA);
    _mm_prefetch(reinterpret_cast<const char*>(w + 4096 + 64), _MM_HINT_NTA);
    const I32 w0 = load_i(w), w1 = load_i(w + 64);
    for (int r = 0; r < ROWS; ++r) {
      const I32 x = broadcast4(j.main + (r0 + r) * Kp + 4 * c);
      acc[r][0] = dot_u8(acc[r][0], w0, x);
      acc[r][1] = dot_u8(acc[r][1], w1, x);
    }
  }
  // The outlier codes, only over the chunks holding them (the tile's codes are in L1 by now);
  // alternate chunks go to two accumulator pairs so consecutive vpdpbusd do not wait on each other.
  for (int r = 0; r < ROWS; ++r) {
    const RowPlan& p = j.plan[r0 + r];
    for (int i = 0; i < p.num_chunks; ++i) {
      const int64_t c = p.chunks[i];
      const I32 w0 = load_i(tile + c * kChunkBytes), w1 = load_i(tile + c * kChunkBytes + 64);
      const I32 x = broadcast4(j.out + (r0 + r) * Kp + 4 * c);
      acc_out[r][i & 1][0] = dot_u8(acc_out[r][i & 1][0], w0, x);
      acc_out[r][i & 1][1] = dot_u8(acc_out[r][i & 1][1], w1, x);
    }
  }
  const float* meta = j.meta + t * kMetaRows * kCols;
  const F32 margin = set1_f(1.f / 65536), c0 = set1_f(j.C);
  for (int r = 0; r < ROWS; ++r) {
    const RowPlan& p = j.plan[r0 + r];
    // The codes were stored as q + 128: sum (q + 128) x = sum q x + 128 sum x (dot_u8 gives the
    // first sum, or with kDotU8Centred the second).
    const I32 fix_main = set1_i(kDotU8Centred ? 0 : 128 * p.sum_main);
    const I32 fix_out = set1_i(kDotU8Centred ? 0 : 128 * p.sum_out);
    const F32 sm = set1_f(p.sm), so = set1_f(p.so);
    F32 up = set1_f(-INFINITY), down = up;
    for (int h = 0; h < 2; ++h) {
      const F32 s = load_f(meta + 16 * h), d2 = load_f(meta + kCols + 16 * h),
                   w2 = load_f(meta + 2 * kCols + 16 * h);
      const F32 part_main = mul_f(sm, to_f(sub_i(acc[r][h], fix_main)));
      const F32 part_out = mul_f(
          so, to_f(sub_i(add_i(acc_out[r][0][h], acc_out[r][1][h]), fix_out)));
      const F32 a = mul_f(add_f(part_main, part_out), s);
      // The margin scales with the parts, not their sum: they may cancel.
      const F32 size = mul_f(add_f(abs_f(part_main), abs_f(part_out)), s);
      F32 e = fmadd(set1_f(p.A), d2, fmadd(set1_f(p.B), w2, c0));
      e = fmadd(add_f(e, size), margin, e);
      up = max_f(up, add_f(a, e));
      down = max_f(down, sub_f(a, e));
    }
    j.upper[(r0 + r) * j.T + t] = reduce_max_f(up);
    j.lower[(r0 + r) * j.T + t] = reduce_max_f(down);
  }
}

void screen_item(void* ctx, int64_t item) {
  const ScreenJob& j = *static_cast<const ScreenJob*>(ctx);
  for (int64_t t = item * j.per_item; t < std::min(j.T, (item + 1) * j.per_item); ++t) {
    int64_t r = 0;
    for (; r + 4 <= j.rows; r += 4) screen_tile<4>(j, r, t);
    switch (j.rows - r) {
      case 3: screen_tile<3>(j, r, t); break;
      case 2: screen_tile<2>(j, r, t); break;
      case 1: screen_tile<1>(j, r, t); break;
      default: break;
    }
  }
}
#else
constexpr bool kHaveInt8Dot = false;
void screen_item(void*, int64_t) {}
#endif

// ---- exact tiles ---------------------------------------------------------------------------------------

struct ExactJob {
  const float* x;  // [B, K]
  const float* w;  // [T, K, 32]
  int64_t B, K;
  const int64_t* tiles;        // tiles with work, ascending
  const int64_t* tile_start;   // [num tiles + 1]: their entries in entry_row / entry_slot
  const int64_t* entry_row;
  const int64_t* entry_slot;
  float* best_value;           // per slot: the tile's largest value (NaN as -inf) ...
  int64_t* best_index;         // ... and its first column
};

// Rows ``rows`` (all with the same chain choice) of tile t: f32_linear_tile over a contiguous
// copy of their hidden states, then each row's first largest value in the tile.
void exact_rows(const ExactJob& j, int64_t t, const int64_t* rows, const int64_t* slots, int64_t n, bool two_chains,
                fd_kernels::LineBuffer<float>& xbuf, fd_kernels::LineBuffer<float>& ybuf) {
  xbuf.resize(n * j.K);
  ybuf.resize(n * kCols);
  for (int64_t i = 0; i < n; ++i) std::memcpy(xbuf.data() + i * j.K, j.x + rows[i] * j.K, j.K * sizeof(float));
  fd_kernels::f32_linear_tile(xbuf.data(), n, j.K, j.w, t, two_chains, ybuf.data());
  for (int64_t i = 0; i < n; ++i) {
    const float* y = ybuf.data() + i * kCols;
    int64_t best = 0;
    for (int64_t c = 1; c < kCols; ++c)
      if (ordered(y[c]) > ordered(y[best])) best = c;
    j.best_value[slots[i]] = ordered(y[best]);
    j.best_index[slots[i]] = t * kCols + best;
  }
}

void exact_item(void* ctx, int64_t item) {
  const ExactJob& j = *static_cast<const ExactJob*>(ctx);
  thread_local fd_kernels::LineBuffer<float> xbuf, ybuf;  // the tile's output rows are stored as vectors
  const int64_t t = j.tiles[item];
  std::vector<int64_t> rows[2], slots[2];  // [0]: one chain, [1]: two chains
  for (int64_t e = j.tile_start[item]; e < j.tile_start[item + 1]; ++e) {
    const int two = fd_kernels::f32_linear_two_chains(j.entry_row[e], j.B) ? 1 : 0;
    rows[two].push_back(j.entry_row[e]);
    slots[two].push_back(j.entry_slot[e]);
  }
  for (int two = 0; two < 2; ++two)
    if (!rows[two].empty())
      exact_rows(j, t, rows[two].data(), slots[two].data(), rows[two].size(), two == 1, xbuf, ybuf);
}

// ---- the op ---------------------------------------------------------------------------------------------

void check_weight(const paddle::Tensor& weight, int64_t* T, int64_t* K) {
  const auto& s = weight.shape();
  PD_CHECK(weight.dtype() == paddle::DataType::FLOAT32 && s.size() == 3 && s[2] == kCols,
           "the greedy head takes the packed float32 head weight [V / 32, K, 32] (CpuOps.prepare_linear_weight's layout)");
  PD_CHECK(s[0] > 0 && s[1] > 0, "the greedy head needs a non-empty head weight");
  PD_CHECK(s[1] <= kMaxK, "the greedy head's int32 dot products hold K <= ", kMaxK, ", got K = ", s[1]);
  *T = s[0];
  *K = s[1];
}

// Which tiles each row recomputes, as per-row lists (ascending) in one array.
struct TilePlan {
  std::vector<int64_t> row_start, tile;  // row b's tiles: tile[row_start[b] .. row_start[b + 1])
};

TilePlan choose_tiles(const std::vector<RowPlan>& plan, const std::vector<int64_t>& screen_index,
                      const std::vector<float>& upper, const std::vector<float>& lower, int64_t B, int64_t T) {
  TilePlan out;
  out.row_start.assign(B + 1, 0);
  std::vector<int64_t> picked;
  for (int64_t b = 0; b < B; ++b) {
    picked.clear();
    if (plan[b].screened) {
      const float* up = upper.data() + screen_index[b] * T;
      const float* down = lower.data() + screen_index[b] * T;
      const float L = *std::max_element(down, down + T);
      for (int64_t t = 0; t < T; ++t)
        if (up[t] >= L) picked.push_back(t);
    }
    if (!plan[b].screened || static_cast<int64_t>(picked.size()) * kFullRowFraction > T) {
      picked.resize(T);
      for (int64_t t = 0; t < T; ++t) picked[t] = t;
    }
    out.tile.insert(out.tile.end(), picked.begin(), picked.end());
    out.row_start[b + 1] = out.tile.size();
  }
  return out;
}

}  // namespace

std::vector<paddle::Tensor> GreedyHeadPrepare(const paddle::Tensor& weight_in) {
  int64_t T, K;
  check_weight(weight_in, &T, &K);
  const paddle::Tensor weight = weight_in.contiguous();
  const int64_t Kc = (K + 3) / 4;
  auto screen = paddle::empty({T, Kc, kCols, 4}, paddle::DataType::UINT8, paddle::CPUPlace());
  auto meta = paddle::empty({T, kMetaRows, kCols}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  PrepareJob job{weight.data<float>(), K, Kc, screen.data<uint8_t>(), meta.data<float>()};
  fd_kernels::Pool::instance().run(T, prepare_tile, &job);
  return {screen, meta};
}

std::vector<paddle::Tensor> GreedyHead(const paddle::Tensor& hidden_in, const paddle::Tensor& weight_in,
                                       const paddle::Tensor& screen_in, const paddle::Tensor& meta_in) {
  int64_t T, K;
  check_weight(weight_in, &T, &K);
  const int64_t Kc = (K + 3) / 4;
  PD_CHECK(hidden_in.dtype() == paddle::DataType::FLOAT32 && hidden_in.shape().size() == 2 && hidden_in.shape()[1] == K,
           "fd_greedy_head: hidden must be float32 [B, ", K, "]");
  PD_CHECK(screen_in.dtype() == paddle::DataType::UINT8 && screen_in.shape() == std::vector<int64_t>({T, Kc, kCols, 4}),
           "fd_greedy_head: screen must be fd_greedy_head_prepare's uint8 [", T, ", ", Kc, ", 32, 4] for this weight");
  PD_CHECK(meta_in.dtype() == paddle::DataType::FLOAT32 && meta_in.shape() == std::vector<int64_t>({T, kMetaRows, kCols}),
           "fd_greedy_head: meta must be fd_greedy_head_prepare's float32 [", T, ", 3, 32] for this weight");
  const paddle::Tensor hidden = hidden_in.contiguous(), weight = weight_in.contiguous();
  const paddle::Tensor screen = screen_in.contiguous(), meta = meta_in.contiguous();
  const int64_t B = hidden.shape()[0];
  const float* x = hidden.data<float>();
  const float* m = meta.data<float>();
  auto tokens = paddle::empty({B}, paddle::DataType::INT64, paddle::CPUPlace());
  auto counts = paddle::empty({B}, paddle::DataType::INT64, paddle::CPUPlace());
  if (B == 0) return {tokens, counts};

  float w2_max = 0.f;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < kCols; ++n) w2_max = std::max(w2_max, m[(t * kMetaRows + 2) * kCols + n]);

  // Pass 1: codes and bounds per row; screen the rows that can be screened.
  std::vector<RowPlan> plan(B);
  std::vector<int64_t> screen_index(B, -1);
  std::vector<RowPlan> screened;
  std::vector<int8_t> main_codes(B * Kc * 4), out_codes(B * Kc * 4);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = screened.size();
    plan[b] = kHaveInt8Dot ? plan_row(x + b * K, K, Kc, w2_max, main_codes.data() + s * Kc * 4, out_codes.data() + s * Kc * 4) : RowPlan{};
    if (plan[b].screened) {
      screen_index[b] = s;
      screened.push_back(plan[b]);
    }
  }
  const int64_t S = screened.size();
  std::vector<float> upper(S * T), lower(S * T);
  if (S > 0) {
    // Work items of consecutive tiles, ~4 per thread: each thread streams contiguous codes.
    const int64_t items = 4 * fd_kernels::Pool::instance().threads();
    ScreenJob job{screen.data<uint8_t>(), m, T, Kc, static_cast<float>((2.0 * K + 2) * 0x1p-126), S, main_codes.data(), out_codes.data(),
                  screened.data(), upper.data(), lower.data(), std::max<int64_t>(1, (T + items - 1) / items)};
    fd_kernels::Pool::instance().run((T + job.per_item - 1) / job.per_item, screen_item, &job);
  }

  // Pass 2: each row's candidate tiles, regrouped by tile (every tile computed once for all its rows).
  const TilePlan tiles = choose_tiles(plan, screen_index, upper, lower, B, T);
  std::vector<int64_t> per_tile(T + 1, 0);
  for (int64_t t : tiles.tile) ++per_tile[t + 1];
  std::vector<int64_t> active, tile_start(1, 0);
  for (int64_t t = 0; t < T; ++t)
    if (per_tile[t + 1] > 0) {
      active.push_back(t);
      tile_start.push_back(tile_start.back() + per_tile[t + 1]);
    }
  std::vector<int64_t> fill(T, -1);
  for (size_t i = 0; i < active.size(); ++i) fill[active[i]] = tile_start[i];
  std::vector<int64_t> entry_row(tiles.tile.size()), entry_slot(tiles.tile.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = tiles.row_start[b]; s < tiles.row_start[b + 1]; ++s) {
      const int64_t e = fill[tiles.tile[s]]++;
      entry_row[e] = b;
      entry_slot[e] = s;
    }

  // Pass 3: the candidate tiles in float32, then per row the first largest over its tiles in order.
  std::vector<float> best_value(tiles.tile.size());
  std::vector<int64_t> best_index(tiles.tile.size());
  ExactJob job{x, weight.data<float>(), B, K, active.data(), tile_start.data(), entry_row.data(), entry_slot.data(),
               best_value.data(), best_index.data()};
  fd_kernels::Pool::instance().run(active.size(), exact_item, &job);
  int64_t* out = tokens.data<int64_t>();
  int64_t* out_counts = counts.data<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    int64_t best = tiles.row_start[b];
    for (int64_t s = best + 1; s < tiles.row_start[b + 1]; ++s)
      if (best_value[s] > best_value[best]) best = s;  // strictly: an earlier tile keeps a tie
    out[b] = best_index[best];
    out_counts[b] = tiles.row_start[b + 1] - tiles.row_start[b];
  }
  return {tokens, counts};
}

std::vector<std::vector<int64_t>> GreedyHeadShape(const std::vector<int64_t>& x, const std::vector<int64_t>&,
                                                  const std::vector<int64_t>&, const std::vector<int64_t>&) {
  return {{x[0]}, {x[0]}};
}

std::vector<paddle::DataType> GreedyHeadDtype(const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
                                              const paddle::DataType&) {
  return {paddle::DataType::INT64, paddle::DataType::INT64};
}

std::vector<std::vector<int64_t>> GreedyPrepareShape(const std::vector<int64_t>& w) {
  return {{w[0], (w[1] + 3) / 4, kCols, 4}, {w[0], kMetaRows, kCols}};
}

std::vector<paddle::DataType> GreedyPrepareDtype(const paddle::DataType&) {
  return {paddle::DataType::UINT8, paddle::DataType::FLOAT32};
}

PD_BUILD_OP(fd_greedy_head)
    .Inputs({"Hidden", "Weight", "Screen", "Meta"})
    .Outputs({"Tokens", "Tiles"})
    .SetKernelFn(PD_KERNEL(GreedyHead))
    .SetInferShapeFn(PD_INFER_SHAPE(GreedyHeadShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(GreedyHeadDtype));

PD_BUILD_OP(fd_greedy_head_prepare)
    .Inputs({"Weight"})
    .Outputs({"Screen", "Meta"})
    .SetKernelFn(PD_KERNEL(GreedyHeadPrepare))
    .SetInferShapeFn(PD_INFER_SHAPE(GreedyPrepareShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(GreedyPrepareDtype));
