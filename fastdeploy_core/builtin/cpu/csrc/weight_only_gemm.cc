// Linear-layer GEMM for the cpu device: y[M, N] = x[M, K] @ dequant(W)[K, N], for float32
// weights and for quantized ones.
//
// Quantized weights stay compact in memory and are widened to float inside the inner loop, so
// a batch-1 decode step reads 1 (int8, fp8) or 0.5 (int4) bytes per weight instead of 4.
//
// Packed layout. Every kind also takes its weight as [N / 32, R, 32] (R = K, or K / 2 for
// int4) instead of [R, N]: the 32 output columns of one tile are then one contiguous stream
// over K. Row-major, a tile reads 32 * elem bytes per row, N * elem bytes apart, which the
// hardware prefetcher does not follow: a batch-1 decode read float32 weights at ~13-15 GB/s
// that way and at ~25-40 GB/s packed (MKL's sgemm: ~15). The layout is chosen by the rank of
// the weight tensor; scales and offsets keep [G, N]. int4 also has a rank-4 layout for integer
// dot products, [N / 32, K / 8, 32, 4] (see "int4 with integer dot products" below).
//
// Row-major layouts (Paddle's [in, out] orientation: row k of W is contiguous over the N outputs).
// Groups run along K: group g covers rows [g * group_size, min(K, (g + 1) * group_size)), so
// the last group may be shorter (K = 576 with groups of 128 has a last group of 64 rows).
//   int8: W int8 [K, N]; scale float32 [G, N]; w[k, n] = W[k, n] * scale[g, n]
//         (G = 1 is per-channel; groups of 32 hold GGUF Q8_0 blocks).
//   int4: W uint8 [K / 2, N]; byte (p, n) holds row 2p in its low and row 2p + 1 in its high
//         nibble, q in [0, 15]; scale, offset float32 [G, N]; w[k, n] = q * scale + offset
//         (symmetric int4: offset = -8 * scale; GGUF Q4_1: offset = min; Q4_0: -8 * d).
//   fp8:  W float8_e4m3fn [K, N] (bit pattern s eeee mmm, bias 7); scale float32 [G, N]
//         (block-wise fp8 repeats each 128 x 128 block's scale over the block's columns).
//   f32:  W float32 [K, N], no scale.
// Inside a group, sum_k x[k] * (q * s + o) = s * sum_k x[k] * q + o * sum_k x[k]: the inner
// loop is one multiply-add per weight and the group sums of x are computed once per call.
//
// With act_int8 the rows of x are first rounded to int8 with one dynamic scale per row
// (|x|max / 127, round to nearest, ties to even, as paddle.round): W8A8 / W4A8. The products of
// integer-valued floats are exact; the sums are float32.
//
// Vectors are vector_math.h's 16-lane types: one AVX-512 register, or a pair of AVX2 registers.
//
// Threads (thread_pool.h) split the output columns into chunks of one or two tiles (the int4
// VNNI loop: runs of consecutive tiles, ~4 per core).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "amx_tiles.h"
#include "f32_tiles.h"
#include "paddle/extension.h"
#include "vector_math.h"
#include "graph.h"
#include "int8_dot.h"
#include "line_buffer.h"
#include "thread_pool.h"

namespace {

using fd_kernels::bitcast;
using fd_kernels::convert;
using fd_kernels::f32x16;
using fd_kernels::i32x16;
using fd_kernels::select;

enum class Kind { kInt8, kInt4, kFp8, kF32 };

constexpr int64_t kCols = fd_kernels::kTileColumns;  // output columns per tile: two vectors
constexpr int64_t kPrefetchRows = 16;  // weight rows a few-row tile asks for ahead of its loads
// A tile's geometry: rows of x per tile and 16-column vectors per row, sized to the register file.
#if defined(__AVX512F__)
// 32 zmm registers: whole 32-column tiles (2 vectors per row), 4 rows (8 for float32 weights: no
// widening, more FMAs per load).
constexpr int kTileVecs = 2;
template <Kind KIND>
constexpr int kRowsFor = KIND == Kind::kF32 ? 8 : 4;
#else
// 16 ymm registers, a 16-column vector is two of them: half tiles (16 columns), 6 rows for
// float32 (12 accumulators, the weights as memory operands; the sums are the results) and 3 for
// the quantized kinds (6 accumulators, 6 running totals, the widened weights). fd_f32_linear of
// [M, 576] x [576, 1536] on an AVX2 EPYC 7002 (Zen 2, 2 threads): whole tiles of 8 rows 68-72
// GFLOP/s at M = 16-512, half tiles of 6 rows 76-93 (Paddle's matmul: 76-88). Steps of few
// rows still take whole tiles (kWholeTileRowsMax, tile_rows): one pass over each tile's weights.
constexpr int kTileVecs = 1;
template <Kind KIND>
constexpr int kRowsFor = KIND == Kind::kF32 ? 6 : 3;
#endif
// Steps of up to this many rows take whole tiles whatever kTileVecs says.
constexpr int64_t kWholeTileRowsMax = 8;

using fd_kernels::load16;
using fd_kernels::store16;

// Ask for the ``bytes`` weight bytes kPrefetchRows rows below ``row``.
inline void prefetch_ahead(const uint8_t* row, int64_t row_bytes, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * row_bytes + b), _MM_HINT_T0);
}

// Byte -> int32 widening uses intrinsics: GCC lowers __builtin_convertvector of 16 bytes to
// 16 ints as scalar inserts, which made the int8 loop ~10x slower.
inline i32x16 widen_bytes(const void* p, bool is_signed) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  const __m512i w = is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  i32x16 r;
  std::memcpy(&r, &w, sizeof(r));
  return r;
#elif defined(__AVX2__)
  const __m128i b0 = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  const __m128i b1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const char*>(p) + 8));
  const __m256i lo = is_signed ? _mm256_cvtepi8_epi32(b0) : _mm256_cvtepu8_epi32(b0);
  const __m256i hi = is_signed ? _mm256_cvtepi8_epi32(b1) : _mm256_cvtepu8_epi32(b1);
  i32x16 r;
  std::memcpy(&r.lo, &lo, 32);
  std::memcpy(&r.hi, &hi, 32);
  return r;
#else
  i32x16 r;
  for (int i = 0; i < 16; ++i)
    r[i] = is_signed ? static_cast<const int8_t*>(p)[i] : static_cast<const uint8_t*>(p)[i];
  return r;
#endif
}

// Sixteen weights of row ``row`` (bytes of the weight array) widened to float32.
template <Kind KIND>
inline f32x16 load_w(const uint8_t* row);

inline f32x16 widen_i8(const uint8_t* p) { return convert<f32x16>(widen_bytes(p, true)); }

inline void widen_u4(const uint8_t* p, f32x16* lo, f32x16* hi) {
  const i32x16 w = widen_bytes(p, false);
  *lo = convert<f32x16>(w & 15);
  *hi = convert<f32x16>(w >> 4);
}

// float8 e4m3fn -> float32 exactly: a normal value moves its exponent from bias 7 to bias 127
// (add 120 to the exponent field); a subnormal one (exponent 0) is mantissa * 2^-9.
inline f32x16 widen_fp8(const uint8_t* p) {
  const i32x16 b = widen_bytes(p, false);
  const i32x16 magnitude = b & 0x7F;
  const i32x16 sign = (b & 0x80) << 24;
  const i32x16 normal = ((magnitude << 20) + (120 << 23)) | sign;
  const f32x16 tiny = convert<f32x16>(magnitude) * (1.0f / 512.0f);
  const i32x16 subnormal = bitcast<i32x16>(tiny) | sign;
  return bitcast<f32x16>(select((magnitude >> 3) == 0, subnormal, normal));
}

inline float scalar_fp8(uint8_t b) {
  const int magnitude = b & 0x7F;
  const float v = (magnitude >> 3) == 0 ? magnitude / 512.0f : std::ldexp(1.0f + (magnitude & 7) / 8.0f, (magnitude >> 3) - 7);
  return (b & 0x80) ? -v : v;
}

template <>
inline f32x16 load_w<Kind::kInt8>(const uint8_t* row) { return widen_i8(row); }
template <>
inline f32x16 load_w<Kind::kFp8>(const uint8_t* row) { return widen_fp8(row); }
template <>
inline f32x16 load_w<Kind::kF32>(const uint8_t* row) { return load16(reinterpret_cast<const float*>(row)); }

// Bytes per weight element for the byte-addressed kinds.
template <Kind KIND>
constexpr int64_t kElem = KIND == Kind::kF32 ? 4 : 1;

struct Problem {
  const float* x;  // [M, K]
  int64_t M, K, N;
  const uint8_t* w;
  const float* scale;   // [G, N]
  const float* offset;  // [G, N] or nullptr
  const float* xsum;    // [M, G] group sums of x, when offset != nullptr
  int64_t G, group;
  float* y;  // [M, N]
  // Where the 32 weights of (row k, tile t = n0 / 32) start: w + t * tile_bytes + k' * row_bytes
  // (k' = k, or k / 2 for int4). Row-major [K, N]: row_bytes = N * elem, tile_bytes = 32 * elem.
  // Packed [N / 32, K, 32]: row_bytes = 32 * elem, tile_bytes = K * 32 * elem, so one tile's
  // weights are one contiguous stream.
  int64_t row_bytes, tile_bytes;
};

// Whether a tile of ROWS rows splits each accumulator into two dependency chains (even and
// odd k, summed at the end): the default for 1-2 rows. Rows of one tile never interact, so a
// row's float32 result depends only on this choice (fd_f32_linear_tile relies on that).
constexpr bool two_chains_for(int rows) { return rows <= 2; }

// One tile: ROWS rows of x (starting at row m) times columns [n0, n0 + 16 V) of W, inside one
// 32-column tile of the layout (V = 2: the whole tile; V = 1: either half).
// STREAM: the step has few rows and streams its weights once: ask for them kPrefetchRows rows
// ahead (tiles of two chains always do).
template <int ROWS, Kind KIND, bool TWO_CHAINS = two_chains_for(ROWS), int V = 2, bool STREAM = false>
void tile(const Problem& p, int64_t m, int64_t n0) {
  static_assert(V == 1 || V == 2, "a tile covers one or two 16-column vectors");
  const int64_t K = p.K, N = p.N;
  const float* x = p.x + m * K;
  // The weights of tile n0 / 32 from its column n0 % 32 on (int4: a byte holds two rows, so a
  // column is one byte of a row pair).
  const uint8_t* w = p.w + (n0 / kCols) * p.tile_bytes + (n0 % kCols) * (KIND == Kind::kInt4 ? 1 : kElem<KIND>);
  constexpr int64_t kVecBytes = 16 * kElem<KIND>;  // one vector's weights within a row
  f32x16 total[ROWS][V];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < V; ++v) total[r][v] = f32x16{};
  for (int64_t g = 0; g < p.G; ++g) {
    f32x16 acc[ROWS][V];
    // With few rows the multiply-adds of consecutive k would form one dependency chain per
    // accumulator (4-cycle FMA latency); a second accumulator set lets two k run at once.
    f32x16 acc2[ROWS][V];
    for (int r = 0; r < ROWS; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = acc2[r][v] = f32x16{};
    const int64_t k_begin = g * p.group, k_end = std::min(K, k_begin + p.group);
    if constexpr (KIND == Kind::kInt4) {
      for (int64_t k = k_begin; k < k_end; k += 2) {
        const uint8_t* row = w + (k / 2) * p.row_bytes;
        f32x16 lo[V], hi[V];
        for (int v = 0; v < V; ++v) widen_u4(row + 16 * v, &lo[v], &hi[v]);
        for (int r = 0; r < ROWS; ++r) {
          const float xa = x[r * K + k], xb = x[r * K + k + 1];
          for (int v = 0; v < V; ++v) {
            acc[r][v] += xa * lo[v];
            if constexpr (TWO_CHAINS)
              acc2[r][v] += xb * hi[v];
            else
              acc[r][v] += xb * hi[v];
          }
        }
      }
    } else {
      int64_t k = k_begin;
      if constexpr (TWO_CHAINS) {
        for (; k + 1 < k_end; k += 2) {
          const uint8_t* row = w + k * p.row_bytes;
          // A batch-1/2 tile streams its weights once: ask for them kPrefetchRows rows ahead.
          prefetch_ahead(row, p.row_bytes, 2 * V * kVecBytes);
          f32x16 wa[V], wb[V];
          for (int v = 0; v < V; ++v) {
            wa[v] = load_w<KIND>(row + v * kVecBytes);
            wb[v] = load_w<KIND>(row + p.row_bytes + v * kVecBytes);
          }
          for (int r = 0; r < ROWS; ++r) {
            const float xa = x[r * K + k], xb = x[r * K + k + 1];
            for (int v = 0; v < V; ++v) {
              acc[r][v] += xa * wa[v];
              acc2[r][v] += xb * wb[v];
            }
          }
        }
      }
      // Unrolled: the loop's counter, compare and branch once per 4 k instead of every k (they
      // share ports with the multiply-adds). Same operations in the same order.
#pragma GCC unroll 4
      for (; k < k_end; ++k) {
        const uint8_t* row = w + k * p.row_bytes;
        if constexpr (STREAM && !TWO_CHAINS) prefetch_ahead(row, p.row_bytes, V * kVecBytes);
        f32x16 wa[V];
        for (int v = 0; v < V; ++v) wa[v] = load_w<KIND>(row + v * kVecBytes);
        for (int r = 0; r < ROWS; ++r) {
          const float xv = x[r * K + k];
          for (int v = 0; v < V; ++v) acc[r][v] += xv * wa[v];
        }
      }
    }
    if constexpr (TWO_CHAINS) {
      for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < V; ++v) acc[r][v] += acc2[r][v];
    }
    if constexpr (KIND == Kind::kF32) {
      // One group (gemm's float32 callers pass G = 1): the sums are the results. Storing them
      // here keeps ``total`` out of the registers the k loop needs.
      for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < V; ++v) store16(p.y + (m + r) * N + n0 + 16 * v, acc[r][v]);
      return;
    } else {
      for (int v = 0; v < V; ++v) {
        const f32x16 sv = load16(p.scale + g * N + n0 + 16 * v);
        for (int r = 0; r < ROWS; ++r) total[r][v] += acc[r][v] * sv;
      }
    }
    if (p.offset != nullptr) {
      for (int v = 0; v < V; ++v) {
        const f32x16 ov = load16(p.offset + g * N + n0 + 16 * v);
        for (int r = 0; r < ROWS; ++r) total[r][v] += p.xsum[(m + r) * p.G + g] * ov;
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < V; ++v) store16(p.y + (m + r) * N + n0 + 16 * v, total[r][v]);
}

// Columns past the last full tile (N % 32), one at a time.
template <Kind KIND>
void tail_column(const Problem& p, int64_t n) {
  const int64_t K = p.K, N = p.N;
  for (int64_t m = 0; m < p.M; ++m) {
    float total = 0.f;
    for (int64_t g = 0; g < p.G; ++g) {
      float acc = 0.f;
      for (int64_t k = g * p.group; k < std::min(K, (g + 1) * p.group); ++k) {
        float q;
        if constexpr (KIND == Kind::kInt4) {
          const uint8_t byte = p.w[(k / 2) * N + n];
          q = static_cast<float>((k & 1) ? (byte >> 4) : (byte & 15));
        } else if constexpr (KIND == Kind::kF32) {
          q = reinterpret_cast<const float*>(p.w)[k * N + n];
        } else if constexpr (KIND == Kind::kInt8) {
          q = static_cast<float>(static_cast<int8_t>(p.w[k * N + n]));
        } else {
          q = scalar_fp8(p.w[k * N + n]);
        }
        acc += p.x[m * K + k] * q;
      }
      total += KIND == Kind::kF32 ? acc : acc * p.scale[g * N + n];
      if (p.offset != nullptr) total += p.xsum[m * p.G + g] * p.offset[g * N + n];
    }
    p.y[m * N + n] = total;
  }
}

// Rows [m, M) of x times columns [n0, n0 + 16 V): blocks of kRowsFor rows, then the rest.
template <Kind KIND, int V, bool STREAM = false>
void row_blocks(const Problem& q, int64_t n0) {
  // Row blocking (which rows land in a 1-2 row tile) is mirrored by fd_kernels::f32_linear_two_chains.
  constexpr int R = kRowsFor<KIND>;
  int64_t m = 0;
  for (; m + R <= q.M; m += R) tile<R, KIND, two_chains_for(R), V, STREAM>(q, m, n0);
  switch (q.M - m) {
    case 7: tile<7, KIND, two_chains_for(7), V, STREAM>(q, m, n0); break;
    case 6: tile<6, KIND, two_chains_for(6), V, STREAM>(q, m, n0); break;
    case 5: tile<5, KIND, two_chains_for(5), V, STREAM>(q, m, n0); break;
    case 4: tile<4, KIND, two_chains_for(4), V, STREAM>(q, m, n0); break;
    case 3: tile<3, KIND, two_chains_for(3), V, STREAM>(q, m, n0); break;
    case 2: tile<2, KIND, two_chains_for(2), V, STREAM>(q, m, n0); break;
    case 1: tile<1, KIND, two_chains_for(1), V, STREAM>(q, m, n0); break;
    default: break;
  }
}

// Every row of x times tile t (columns [32 t, 32 t + 32)), on the calling thread. A step of a
// few rows is bound by reading the weights: it takes whole tiles (one pass over each tile's
// weight stream); more rows take the geometry of the register file (kTileVecs).
// few_rows: the step has at most kWholeTileRowsMax rows (gemm's q.M; a caller that runs a step's
// rows in panels passes the step's own count, so each row gets the same tiles as in gemm).
template <Kind KIND>
void tile_rows(const Problem& q, int64_t t, bool few_rows) {
  if (few_rows) {
    row_blocks<KIND, 2, true>(q, t * kCols);
    return;
  }
  for (int64_t n0 = t * kCols; n0 < (t + 1) * kCols; n0 += 16 * kTileVecs) row_blocks<KIND, kTileVecs>(q, n0);
}

template <Kind KIND>
void gemm(Problem p) {
  std::vector<float> xsum;
  if (p.offset != nullptr) {
    xsum.assign(p.M * p.G, 0.f);
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t g = 0; g < p.G; ++g) {
        float s = 0.f;
        for (int64_t k = g * p.group; k < std::min(p.K, (g + 1) * p.group); ++k) s += p.x[m * p.K + k];
        xsum[m * p.G + g] = s;
      }
    p.xsum = xsum.data();
  }
  const int64_t full_tiles = p.N / kCols;
  // Chunks of 2 tiles (64 columns) when there are plenty, so claiming stays cheap.
  const int64_t per_chunk = full_tiles >= 16 ? 2 : 1;
  struct Job {
    const Problem* p;
    int64_t full_tiles, per_chunk;
  } job{&p, full_tiles, per_chunk};
  auto chunk = [](void* ctx, int64_t c) {
    const Job& j = *static_cast<Job*>(ctx);
    for (int64_t t = c * j.per_chunk; t < std::min(j.full_tiles, (c + 1) * j.per_chunk); ++t) tile_rows<KIND>(*j.p, t, j.p->M <= kWholeTileRowsMax);
  };
  fd_kernels::Pool::instance().run((full_tiles + per_chunk - 1) / per_chunk, chunk, &job);
  for (int64_t n = full_tiles * kCols; n < p.N; ++n) tail_column<KIND>(p, n);
}

// Per-row dynamic int8 rounding of x: xq = round(x / s) in [-127, 127], s = |x|max / 127.
void quantize_rows(const float* x, int64_t M, int64_t K, float* xq, float* row_scale) {
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[m * K + k]));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    row_scale[m] = s;
    for (int64_t k = 0; k < K; ++k) xq[m * K + k] = std::nearbyint(std::min(127.f, std::max(-127.f, x[m * K + k] / s)));
  }
}

std::vector<int64_t> out_shape(const std::vector<int64_t>& x_shape, int64_t n) {
  std::vector<int64_t> shape(x_shape.begin(), x_shape.end() - 1);
  shape.push_back(n);
  return shape;
}

// ---- int4 with integer dot products (AVX-512 VNNI) ---------------------------------------------
//
// VNNI layout: W uint8 [N / 32, K / 8, 32, 4]. For tile t (columns [32 t, 32 t + 32)) and chunk
// c (rows [8 c, 8 c + 8)), the 128 bytes are 32 columns x 4 bytes; byte j of column n holds
// q[8 c + j, n] in its low and q[8 c + 4 + j, n] in its high nibble. One 64-byte load is then 16
// columns x 4 consecutive k per 32-bit lane, what vpdpbusd (u8 x s8 -> s32, 4 products per
// lane) multiplies: masking the low nibbles gives k 0..3, shifting down the high ones k 4..7.
//
// Activations become int8 pieces per block of B k (B divides the group; 32 when it can):
//   weight-only (wint4): a = round(x / s_b) in [-32639, 32639], s_b = |x|max over the block /
//     32639 (16 bits), split a = 256 * hi + lo with hi = round(a / 256) and lo in [-128, 127];
//     sum_k q a = 256 * sum_k q hi + sum_k q lo, exact in int32. The codes are centred,
//     sum_k (q - 8) a = sum_k q a - 8 * sum_k a (the accumulators start at -8 * sum_k a), so the
//     rounding error of a is weighted by |q - 8| <= 8 instead of q <= 15. Per group:
//     y += sum_b (scale_g * s_b) * intdot_b + (offset_g + 8 * scale_g) * sum_g(x), with the
//     float sum of x. Measured error: ~2-4e-5 of the largest output (the float loop: ~1e-6).
//   act_int8 (w4a8): the per-row int8 codes themselves, one piece, exactly as the reference.
// Scales and offsets are [G, N] or, as the cpu ops store them with this layout, [N / 32, G, 32]
// column tiles (one contiguous stream per tile, like the weights: ~10% faster from DRAM), in
// float32 or float16 (the cpu ops use float16 when it holds them exactly, as for GGUF Q4_0 /
// Q4_1, whose d and m are float16: 20 bytes per 32 weights instead of 24).
// Loops: groups a multiple of 32 with K % 32 == 0 (GGUF Q4, the default 128) run vnni32_tile over
// a block-major activation panel; other multiples of 8 the general vnni_tile. Other group sizes
// (not a multiple of 8), or a build without VNNI, run a plain scalar loop over the same layout
// (correct, slow; the cpu ops only choose this layout when VNNI is there).
// Speed (Zen 4, 2026-11-30): a decode step's 120 projections (66 MB) at batch 1 stream ~20-24 GB/s
// from one thread (the float-FMA layout: ~11), near this VM's ~25 GB/s; at 2-8 rows and in prefill
// the loop is bound by vpdpbusd (1 per cycle: 2 pieces x rows x 8 per 256 weights), ~2.2x the
// float-FMA loop. See benchmarks/quant_kernels.md, "int4 with integer dot products (AVX-512 VNNI)".

constexpr int64_t kVnniChunk = 8;                  // k per chunk
// Whether a one-row tile splits each accumulator into two chains (k 0..3 and 4..7 of a chunk):
// against vpdpbusd's 4-cycle latency on AVX-512. AVX2's products chain through a 1-cycle add,
// and a second set of accumulators would not fit its 16 registers (it spilled).
// (No integer dot products in the build: the scalar loop, which never splits.)
#if defined(FD_INT8_DOT)
constexpr bool kSplitOneRow = FD_INT8_DOT == 512;
#else
constexpr bool kSplitOneRow = false;
#endif
using fd_int8_pieces::kPieceMax;  // |a| bound: a = 256 * hi + lo with hi, lo int8
constexpr int64_t kVnniPrefetch = 4096;            // bytes ahead in the weight stream (prefetchnta)
constexpr int64_t kVnniTileBytes = kCols * 4;      // bytes per chunk of one tile (128)

struct VnniProblem {
  int64_t M, K, N, G, group, block, NB;  // NB = blocks per row = ceil(K / block)
  const uint8_t* w;                       // [N / 32, K / 8, 32, 4]
  const void* scale;                      // [G, N], or packed [N / 32, G, 32]; float32 or float16
  const void* offset;                     // shaped and typed like scale
  bool half;                              // scale and offset are float16
  int64_t s_tile, s_group;                // where (tile t, group g) starts: t * s_tile + g * s_group
  const int8_t* xhi;                      // [M, K] high pieces (nullptr with one piece)
  const int8_t* xlo;                      // [M, K] low pieces, or the int8 codes
  const float* bscale;                    // [M, NB] s_b (nullptr with one piece: 1)
  const int32_t* bsum8;                   // [M, NB] 8 * sum of a over the block (two pieces)
  const float* xsum;                      // [M, G]
  float* y;                               // [M, N]
};

#if defined(FD_INT8_DOT)
using namespace fd_int8_dot;

// Sixteen scales (or offsets) from element ``at`` on, widened from float16 when ``half``.
inline F32 load_scales(const void* base, int64_t at, bool half) {
  if (half) return load_half(static_cast<const uint16_t*>(base) + at);
  return load_f(static_cast<const float*>(base) + at);
}

// The nibble codes of one 128-byte chunk at src (32 columns x 8 k) as vpdpbusd operands:
// [0] / [1] k 0..3 of columns 0..15 / 16..31 (low nibbles), [2] / [3] k 4..7 (high nibbles).
// Software prefetch 4 KB ahead in the weight stream: a one-thread step's 120 calls went from
// ~14-15 to ~17-18 GB/s (the hardware prefetcher alone leaves gaps at this compute density;
// 1-12 KB and T0/T1/NTA hints measured, 2-4 KB NTA/T0 best, noisy).
__attribute__((always_inline)) inline void load_chunk(const uint8_t* src, I32 (&codes)[4]) {
  _mm_prefetch(reinterpret_cast<const char*>(src + kVnniPrefetch), _MM_HINT_NTA);
  _mm_prefetch(reinterpret_cast<const char*>(src + kVnniPrefetch + 64), _MM_HINT_NTA);
  const I32 mask = set1_bytes(0x0F);
  const I32 w0 = load_i(src), w1 = load_i(src + 64);
  codes[0] = and_i(w0, mask);
  codes[1] = and_i(w1, mask);
  // Each byte's high nibble to its low one (the bits a shift moves across bytes are masked off).
  codes[2] = and_i(shr_i(w0, 4), mask);
  codes[3] = and_i(shr_i(w1, 4), mask);
}

// acc += a chunk's codes times 8 int8 activations at x (k 0..3 broadcast against codes[0..1],
// k 4..7 against codes[2..3]); with SPLIT the k 4..7 products go to acc2, a second dependency
// chain (one row: consecutive vpdpbusd would otherwise wait on each other, 4-cycle latency).
// SHORT: the accumulators take short sums (dot16: at most 8 calls each before block_dot widens
// them; blocks of 32 k are 4 chunks, 2 calls per accumulator and chunk at most).
template <bool SPLIT, bool SHORT = false>
__attribute__((always_inline)) inline void dot_chunk(const I32 (&codes)[4], const int8_t* x, I32 (&acc)[2],
                                                     I32 (&acc2)[2]) {
  int32_t a, c;
  std::memcpy(&a, x, 4);
  std::memcpy(&c, x + 4, 4);
  const I32 xa = set1_i(a), xc = set1_i(c);
  auto dot = [](I32 s, I32 u8, I32 s8) __attribute__((always_inline)) { return SHORT ? dot16(s, u8, s8) : dpbusd(s, u8, s8); };
  acc[0] = dot(acc[0], codes[0], xa);
  acc[1] = dot(acc[1], codes[1], xa);
  I32(&second)[2] = SPLIT ? acc2 : acc;
  second[0] = dot(second[0], codes[2], xc);
  second[1] = dot(second[1], codes[3], xc);
}

// A block's integer dot product from its accumulators: low piece + 256 x high piece (two
// pieces), each the sum of its two chains when SPLIT; SHORT accumulators widened first.
template <bool SPLIT, int PIECES, bool SHORT = false>
__attribute__((always_inline)) inline I32 block_dot(I32 lo, I32 lo2, I32 hi, I32 hi2) {
  auto wide = [](I32 s) __attribute__((always_inline)) { return SHORT ? widen16(s) : s; };
  I32 v = wide(lo);
  if constexpr (SPLIT) v = add_i(v, wide(lo2));
  if constexpr (PIECES == 2) {
    I32 u = wide(hi);
    if constexpr (SPLIT) u = add_i(u, wide(hi2));
    v = add_i(v, shl_i(u, 8));
  }
  return v;
}

// ROWS rows of x (from row m) times tile t. PIECES: 2 (weight-only) or 1 (int8 activations).
// CPB: chunks of 8 k per activation block when known at compile time (block 32: 4), else 0.
template <int ROWS, int PIECES, int CPB>
void vnni_tile(const VnniProblem& p, int64_t m, int64_t t) {
  const int64_t K = p.K, N = p.N, n0 = t * kCols;
  const uint8_t* wt = p.w + t * (K / kVnniChunk) * kVnniTileBytes;
  constexpr bool kSplit = ROWS == 1 && kSplitOneRow;
  F32 total[ROWS][2];
  for (int r = 0; r < ROWS; ++r) total[r][0] = total[r][1] = zero_f();
  int64_t b = 0;  // activation block index
  for (int64_t g = 0; g < p.G; ++g) {
    const int64_t k_begin = g * p.group, k_end = std::min(K, k_begin + p.group);
    const int64_t at = t * p.s_tile + g * p.s_group;
    const F32 s0 = load_scales(p.scale, at, p.half), s1 = load_scales(p.scale, at + 16, p.half);
    for (int64_t kb = k_begin; kb < k_end; kb += p.block, ++b) {
      const int64_t ke = std::min(k_end, kb + p.block);
      I32 lo[ROWS][2], lo2[ROWS][2], hi[ROWS][2], hi2[ROWS][2];
      for (int r = 0; r < ROWS; ++r) {
        // Two pieces: start at -8 * sum(a), so the block's sum is that of (q - 8) * a.
        const I32 start = PIECES == 2 ? set1_i(-p.bsum8[(m + r) * p.NB + b]) : zero_i();
        for (int h = 0; h < 2; ++h) {
          lo[r][h] = start;
          lo2[r][h] = hi[r][h] = hi2[r][h] = zero_i();
        }
      }
      auto step = [&](int64_t k) __attribute__((always_inline)) {
        const uint8_t* src = wt + (k / kVnniChunk) * kVnniTileBytes;
        // Software prefetch 4 KB ahead in the weight stream: a one-thread step's 120 calls went
        // from ~14-15 to ~17-18 GB/s (the hardware prefetcher alone leaves gaps at this
        // compute density; 1-12 KB and T0/T1/NTA hints measured, 2-4 KB NTA/T0 best, noisy).
        I32 codes[4];
        load_chunk(src, codes);
        for (int r = 0; r < ROWS; ++r) {
          dot_chunk<kSplit>(codes, p.xlo + (m + r) * K + k, lo[r], lo2[r]);
          if constexpr (PIECES == 2) dot_chunk<kSplit>(codes, p.xhi + (m + r) * K + k, hi[r], hi2[r]);
        }
      };
      if (CPB > 0 && ke - kb == CPB * kVnniChunk) {
        for (int c = 0; c < CPB; ++c) step(kb + c * kVnniChunk);
      } else {
        for (int64_t k = kb; k < ke; k += kVnniChunk) step(k);
      }
      // Fold the block into the totals: total += intdot * (scale_g * s_b).
      for (int r = 0; r < ROWS; ++r) {
        F32 f0 = s0, f1 = s1;
        if constexpr (PIECES == 2) {
          const F32 sb = set1_f(p.bscale[(m + r) * p.NB + b]);
          f0 = mul_f(s0, sb);
          f1 = mul_f(s1, sb);
        }
        for (int h = 0; h < 2; ++h) {
          const I32 v = block_dot<kSplit, PIECES>(lo[r][h], lo2[r][h], hi[r][h], hi2[r][h]);
          total[r][h] = fmadd(to_f(v), h == 0 ? f0 : f1, total[r][h]);
        }
      }
    }
    F32 o0 = load_scales(p.offset, at, p.half), o1 = load_scales(p.offset, at + 16, p.half);
    if constexpr (PIECES == 2) {  // the codes were centred: w = (q - 8) * scale + (offset + 8 * scale)
      const F32 eight = set1_f(8.f);
      o0 = fmadd(s0, eight, o0);
      o1 = fmadd(s1, eight, o1);
    }
    for (int r = 0; r < ROWS; ++r) {
      const F32 xs = set1_f(p.xsum[(m + r) * p.G + g]);
      total[r][0] = fmadd(o0, xs, total[r][0]);
      total[r][1] = fmadd(o1, xs, total[r][1]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    store_f(p.y + (m + r) * N + n0, total[r][0]);
    store_f(p.y + (m + r) * N + n0 + 16, total[r][1]);
  }
}

template <int PIECES, int CPB>
void vnni_tiles(const VnniProblem& q, int64_t t) {
  constexpr int R = 4;
  int64_t m = 0;
  for (; m + R <= q.M; m += R) vnni_tile<R, PIECES, CPB>(q, m, t);
  switch (q.M - m) {
    case 3: vnni_tile<3, PIECES, CPB>(q, m, t); break;
    case 2: vnni_tile<2, PIECES, CPB>(q, m, t); break;
    case 1: vnni_tile<1, PIECES, CPB>(q, m, t); break;
    default: break;
  }
}

template <int PIECES>
void vnni_gemm(const VnniProblem& p) {
  const int64_t tiles = p.N / kCols;
  auto chunk = [](void* ctx, int64_t t) {
    const VnniProblem& q = *static_cast<const VnniProblem*>(ctx);
    if (q.block == 32)
      vnni_tiles<PIECES, 4>(q, t);
    else
      vnni_tiles<PIECES, 0>(q, t);
  };
  fd_kernels::Pool::instance().run(tiles, chunk, const_cast<VnniProblem*>(&p));
}

// x -> int8 pieces per block (see above), and 8 * sum(a) per block. Vectorized: a decode step
// calls this 120 times.
void split_rows_16bit(const float* x, int64_t M, int64_t K, int64_t block, int64_t NB, int8_t* xhi, int8_t* xlo,
                      float* bscale, int32_t* bsum8) {
  const F32 zero = zero_f();
  const I32 lim = set1_i(kPieceMax), nlim = set1_i(-kPieceMax);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    for (int64_t b = 0; b < NB; ++b) {
      const int64_t kb = b * block, ke = std::min(K, kb + block);
      F32 amax = zero;
      int64_t k = kb;
      for (; k + 16 <= ke; k += 16) amax = max_f(amax, abs_f(load_f(xr + k)));
      float a = reduce_max_f(amax);
      for (; k < ke; ++k) a = std::max(a, std::fabs(xr[k]));
      bscale[m * NB + b] = a > 0.f ? a / kPieceMax : 1.f;
      const float inv = a > 0.f ? kPieceMax / a : 0.f;
      const F32 vinv = set1_f(inv);
      I32 vsum = zero_i();
      int32_t sum = 0;
      k = kb;
      for (; k + 16 <= ke; k += 16) {
        I32 q = round_i(mul_f(load_f(xr + k), vinv));
        q = max_i(nlim, min_i(lim, q));
        vsum = add_i(vsum, q);
        const I32 h = high_piece(q);  // round(a / 256)
        const I32 l = low_piece(q, h);  // in [-128, 127]
        store_bytes(xhi + m * K + k, h);
        store_bytes(xlo + m * K + k, l);
      }
      for (; k < ke; ++k) {
        const int q = std::max(-kPieceMax, std::min(kPieceMax, static_cast<int>(std::nearbyint(xr[k] * inv))));
        sum += q;
        const int h = fd_int8_pieces::high_piece(q);
        xhi[m * K + k] = static_cast<int8_t>(h);
        xlo[m * K + k] = static_cast<int8_t>(q - 256 * h);
      }
      bsum8[m * NB + b] = 8 * (sum + reduce_add_i(vsum));
    }
  }
}

// ---- the common case, blocks of 32: groups a multiple of 32 (GGUF Q4: 32), K a multiple of 32 ----
//
// The activations of a call are laid out block-major, so a tile walks three pointers: the
// panel [K / 32, M, 64] (per block and row: 32 low pieces, then 32 high pieces, or the int8
// codes) and meta [K / 32, M, 4] (s_b, -8 * sum a as int32 bits, the float sum of x, unused).
// The offset term is applied per block (offset_g * sum over the block of x; the same sum).
struct Vnni32 {
  int64_t M, K, bpg;  // bpg: blocks of 32 per group
  const uint8_t* w;
  const void* scale;
  const void* offset;
  bool half;
  int64_t s_tile, s_group;
  const int8_t* panel;
  const float* meta;
  float* y;
  int64_t N;
  int64_t per_chunk = 1;  // tiles per work item
};

template <int ROWS, int PIECES>
void vnni32_tile(const Vnni32& p, int64_t m, int64_t t) {
  const int64_t NB = p.K / 32, M = p.M;
  const uint8_t* w = p.w + t * (p.K / kVnniChunk) * kVnniTileBytes;
  const int8_t* xb = p.panel + m * 64;
  const float* mb = p.meta + m * 4;
  constexpr bool kSplit = ROWS == 1 && kSplitOneRow;
  F32 total[ROWS][2];
  for (int r = 0; r < ROWS; ++r) total[r][0] = total[r][1] = zero_f();
  int64_t at = t * p.s_tile, left = 0;
  F32 s0 = zero_f(), s1 = s0, o0 = s0, o1 = s0;
  for (int64_t b = 0; b < NB; ++b, w += 4 * kVnniTileBytes, xb += M * 64, mb += M * 4) {
    if (left == 0) {  // a new group: its scales, and offset + 8 * scale for centred codes
      s0 = load_scales(p.scale, at, p.half);
      s1 = load_scales(p.scale, at + 16, p.half);
      o0 = load_scales(p.offset, at, p.half);
      o1 = load_scales(p.offset, at + 16, p.half);
      if constexpr (PIECES == 2) {
        o0 = fmadd(s0, set1_f(8.f), o0);
        o1 = fmadd(s1, set1_f(8.f), o1);
      }
      at += p.s_group;
      left = p.bpg;
    }
    --left;
    // Short sums (dot16) over the block's 4 chunks; the start value is added once widened.
    I32 lo[ROWS][2], lo2[ROWS][2], hi[ROWS][2], hi2[ROWS][2];
    for (int r = 0; r < ROWS; ++r)
      for (int h = 0; h < 2; ++h) lo[r][h] = lo2[r][h] = hi[r][h] = hi2[r][h] = zero_i();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const uint8_t* src = w + c * kVnniTileBytes;
      I32 codes[4];
      load_chunk(src, codes);
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* xr = xb + r * 64 + c * 8;  // 8 low pieces, the 8 high ones 32 bytes on
        dot_chunk<kSplit, true>(codes, xr, lo[r], lo2[r]);
        if constexpr (PIECES == 2) dot_chunk<kSplit, true>(codes, xr + 32, hi[r], hi2[r]);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      F32 f0 = s0, f1 = s1;
      if constexpr (PIECES == 2) {
        const F32 sb = set1_f(mb[r * 4]);
        f0 = mul_f(s0, sb);
        f1 = mul_f(s1, sb);
      }
      const F32 xs = set1_f(mb[r * 4 + 2]);
      int32_t start = 0;  // -8 * sum(a) over the block (two pieces: the codes are centred)
      if constexpr (PIECES == 2) std::memcpy(&start, mb + r * 4 + 1, 4);
      for (int h = 0; h < 2; ++h) {
        I32 v = block_dot<kSplit, PIECES, true>(lo[r][h], lo2[r][h], hi[r][h], hi2[r][h]);
        if constexpr (PIECES == 2) v = add_i(v, set1_i(start));
        total[r][h] = fmadd(to_f(v), h == 0 ? f0 : f1, total[r][h]);
        total[r][h] = fmadd(h == 0 ? o0 : o1, xs, total[r][h]);
      }
    }
  }
  const int64_t n0 = t * kCols;
  for (int r = 0; r < ROWS; ++r) {
    store_f(p.y + (m + r) * p.N + n0, total[r][0]);
    store_f(p.y + (m + r) * p.N + n0 + 16, total[r][1]);
  }
}

template <int PIECES>
void vnni32_gemm(const Vnni32& p) {
  auto chunk = [](void* ctx, int64_t c) {
    const Vnni32& q = *static_cast<const Vnni32*>(ctx);
    const int64_t tiles = q.N / kCols;
    for (int64_t t = c * q.per_chunk; t < std::min(tiles, (c + 1) * q.per_chunk); ++t) {
      // Four rows per pass (with 2 pieces: 16 int32 accumulators; 2- or 3-row passes measured
      // slower; with AVX2's register pairs 2-row passes measured alike).
      int64_t m = 0;
      for (; m + 4 <= q.M; m += 4) vnni32_tile<4, PIECES>(q, m, t);
      switch (q.M - m) {
        case 3: vnni32_tile<3, PIECES>(q, m, t); break;
        case 2: vnni32_tile<2, PIECES>(q, m, t); break;
        case 1: vnni32_tile<1, PIECES>(q, m, t); break;
        default: break;
      }
    }
  };
  const int64_t tiles = p.N / kCols;
  fd_kernels::Pool::instance().run((tiles + p.per_chunk - 1) / p.per_chunk, chunk, const_cast<Vnni32*>(&p));
}

// x [M, K] -> panel and meta (see Vnni32). act_int8: x holds the int8 codes (as floats).
void vnni32_panel(const float* x, int64_t M, int64_t K, bool act_int8, int8_t* panel, float* meta) {
  const int64_t NB = K / 32;
  const I32 lim = set1_i(kPieceMax), nlim = set1_i(-kPieceMax);
  for (int64_t b = 0; b < NB; ++b)
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K + b * 32;
      int8_t* out = panel + (b * M + m) * 64;
      float* mt = meta + (b * M + m) * 4;
      const F32 v0 = load_f(xr), v1 = load_f(xr + 16);
      mt[2] = reduce_add_f(add_f(v0, v1));
      mt[3] = 0.f;
      if (act_int8) {
        store_bytes(out, round_i(v0));
        store_bytes(out + 16, round_i(v1));
        mt[0] = 1.f;
        mt[1] = 0.f;
        continue;
      }
      const float a = reduce_max_f(max_f(abs_f(v0), abs_f(v1)));
      mt[0] = a > 0.f ? a / kPieceMax : 1.f;
      const F32 inv = set1_f(a > 0.f ? kPieceMax / a : 0.f);
      I32 q0 = round_i(mul_f(v0, inv)), q1 = round_i(mul_f(v1, inv));
      q0 = max_i(nlim, min_i(lim, q0));
      q1 = max_i(nlim, min_i(lim, q1));
      const int32_t start = -8 * reduce_add_i(add_i(q0, q1));
      std::memcpy(mt + 1, &start, 4);
      const I32 h0 = high_piece(q0), h1 = high_piece(q1);
      store_bytes(out, low_piece(q0, h0));
      store_bytes(out + 16, low_piece(q1, h1));
      store_bytes(out + 32, h0);
      store_bytes(out + 48, h1);
    }
}

// ---- AVX2, more than a few rows: each tile widened to float32 once, then the float32 tiles ----
//
// Without VNNI the integer products are vpmaddubsw (one per 32 products and piece, on the one
// vector-multiply pipe of Zen 2), and weight-only activations take two pieces: the cost grows
// with every row, while widening a tile's codes to float32 weights (q * scale + offset, one fused
// multiply-add) costs the same for any number of rows. So with more rows than kIntDotRowsMax,
// AVX2 widens each tile into a per-thread buffer [K, 32] once per call and runs fd_f32_linear's
// tiles over all rows. fd_int4_linear [M, 1536] x [1536, 6144], groups of 32, float16 scales, on an
// AVX2 EPYC 7002 (2 threads, 2026-12-03): integer dots 404 / 759 / 1403 / 2724 us at M = 1 / 2 / 4
// / 8; widened tiles 3002 / 4135 us at M = 12 / 16; the float-FMA layout 702 / 1106 / 1765 /
// 3182 / 4298 / 5920 us. Results of the widened path are those of the float32 formula (~1e-6 of
// the largest output), of the integer one ~2e-5 (the 16-bit activation pieces).
constexpr int64_t kIntDotRowsMax = FD_INT8_DOT == 512 ? INT64_MAX : 8;

struct DequantProblem {
  const float* x;  // [M, K] (act_int8: the int8 codes, as floats)
  int64_t M, K, N, group;
  const uint8_t* w;  // [N / 32, K / 8, 32, 4]
  const void* scale;
  const void* offset;
  bool half;
  int64_t s_tile, s_group;
  float* y;
};

// Tile t's weights as float32 [K, 32] (group a multiple of 8: a chunk of 8 k lies in one group).
void dequant_tile(const DequantProblem& p, int64_t t, float* buf) {
  const uint8_t* wt = p.w + t * (p.K / kVnniChunk) * kVnniTileBytes;
  const I32 mask = set1_i(15);
  for (int64_t c = 0; c < p.K / kVnniChunk; ++c) {
    const int64_t k0 = c * kVnniChunk;
    const int64_t at = t * p.s_tile + (k0 / p.group) * p.s_group;
    for (int h = 0; h < 2; ++h) {
      const F32 sc = load_scales(p.scale, at + 16 * h, p.half), of = load_scales(p.offset, at + 16 * h, p.half);
      // Lane n holds column n's 8 codes: k 0..3 in the low nibbles of bytes 0..3, k 4..7 in the high.
      const I32 lanes = load_i(wt + c * kVnniTileBytes + 64 * h);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const I32 q = and_i(shr_i(lanes, 8 * (j & 3) + 4 * (j >> 2)), mask);
        store_f(buf + (k0 + j) * kCols + 16 * h, fmadd(to_f(q), sc, of));
      }
    }
  }
}

void dequant_gemm(const DequantProblem& p) {
  auto chunk = [](void* ctx, int64_t t) {
    const DequantProblem& q = *static_cast<const DequantProblem*>(ctx);
    float* buf = fd_kernels::tile_buffer(q.K);
    dequant_tile(q, t, buf);
    fd_kernels::f32_tile_rows_one_chain(q.x, q.M, q.K, buf, t, q.N, q.y);
  };
  fd_kernels::Pool::instance().run(p.N / kCols, chunk, const_cast<DequantProblem*>(&p));
}

constexpr bool kHaveInt8Dot = true;
#else
constexpr bool kHaveInt8Dot = false;
#endif

// The VNNI layout's code q[k, n] (any build).
inline int vnni_code(const uint8_t* w, int64_t K, int64_t k, int64_t n) {
  const int64_t t = n / kCols, c = k / kVnniChunk, j = k % kVnniChunk;
  const uint8_t byte = w[(t * (K / kVnniChunk) + c) * kVnniTileBytes + (n % kCols) * 4 + (j & 3)];
  return j < 4 ? (byte & 15) : (byte >> 4);
}

// Any group size, any build: y = x @ (q * scale + offset), x already int8 codes when act_int8.
// IEEE half -> float (portable; the scalar path also runs on builds without F16C).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  if (exp == 0) return (sign ? -1.f : 1.f) * std::ldexp(static_cast<float>(mant), -24);
  const uint32_t bits = exp == 31 ? (sign | 0x7F800000u | (mant << 13)) : (sign | ((exp + 112) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float scale_at(const void* base, int64_t at, bool half) {
  return half ? half_to_float(static_cast<const uint16_t*>(base)[at]) : static_cast<const float*>(base)[at];
}

void vnni_layout_scalar(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* w, const void* scale,
                        const void* offset, bool half, int64_t s_tile, int64_t s_group, int64_t G, int64_t group,
                        float* y) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float total = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float acc = 0.f, xs = 0.f;
        for (int64_t k = g * group; k < std::min(K, (g + 1) * group); ++k) {
          acc += x[m * K + k] * static_cast<float>(vnni_code(w, K, k, n));
          xs += x[m * K + k];
        }
        const int64_t at = (n / kCols) * s_tile + g * s_group + n % kCols;
        total += acc * scale_at(scale, at, half) + xs * scale_at(offset, at, half);
      }
      y[m * N + n] = total;
    }
}

// Activation block length for the VNNI kernel: 32 when it divides the group, else the group
// itself (up to 256), else 16 or 8; 0 when the group is not a multiple of 8 (scalar path).
int64_t vnni_block(int64_t group) {
  if (group % kVnniChunk != 0) return 0;
  if (group % 32 == 0) return 32;
  if (group <= 256) return group;
  return group % 16 == 0 ? 16 : 8;
}

std::vector<paddle::Tensor> run_int4_vnni(const paddle::Tensor& x_in, const paddle::Tensor& weight,
                                          const paddle::Tensor& scale, const paddle::Tensor& offset,
                                          int64_t group_size, bool act_int8) {
  const auto& shape = weight.shape();
  PD_CHECK(shape[2] == kCols && shape[3] == 4, "a VNNI-packed int4 weight is [N / 32, K / 8, 32, 4]");
  const int64_t K = shape[1] * kVnniChunk, N = shape[0] * kCols;
  PD_CHECK(x_in.dtype() == paddle::DataType::FLOAT32, "x must be float32");
  PD_CHECK(x_in.shape().back() == K, "x's last axis (", x_in.shape().back(), ") must equal the weight's K (", K, ")");
  PD_CHECK(group_size >= 1, "group_size must be positive");
  const int64_t G = (K + group_size - 1) / group_size;
  const auto& ss = scale.shape();
  const bool tiled_scale = ss.size() == 3;
  const bool half = scale.dtype() == paddle::DataType::FLOAT16;
  PD_CHECK((half || scale.dtype() == paddle::DataType::FLOAT32) &&
               (tiled_scale ? ss[0] * kCols == N && ss[2] == kCols : ss.size() == 2 && ss[1] == N),
           "scale must be float32 or float16, [G, N] or [N / 32, G, 32]");
  PD_CHECK(ss[tiled_scale ? 1 : 0] == G, "scale has ", ss[tiled_scale ? 1 : 0], " groups; K=", K, " in groups of ",
           group_size, " needs ", G);
  PD_CHECK(offset.shape() == scale.shape() && offset.dtype() == scale.dtype(),
           "offset must be shaped and typed like scale");
  const int64_t s_tile = tiled_scale ? G * kCols : kCols, s_group = tiled_scale ? kCols : N;
  auto out = fd_graph::empty(out_shape(x_in.shape(), N), paddle::DataType::FLOAT32);
  fd_graph::run("fd_int4_linear", {&x_in, &weight, &scale, &offset}, {&out}, [=]() mutable {
    const paddle::Tensor x = x_in.contiguous();
    const int64_t M = K > 0 ? x.numel() / K : 0;
    const float* xp = x.data<float>();
    float* y = out.data<float>();
    const uint8_t* w = static_cast<const uint8_t*>(weight.data());
    std::vector<float> xq, row_scale;
    if (act_int8) {
      xq.resize(M * K);
      row_scale.resize(M);
      quantize_rows(xp, M, K, xq.data(), row_scale.data());
      xp = xq.data();
    }
    const int64_t block = act_int8 ? (group_size % kVnniChunk == 0 ? group_size : 0) : vnni_block(group_size);
    if (!kHaveInt8Dot || block == 0 || M == 0) {
      vnni_layout_scalar(xp, M, K, N, w, scale.data(), offset.data(), half, s_tile, s_group, G, group_size, y);
    } else {
#if defined(FD_INT8_DOT)
      if (M > kIntDotRowsMax) {
        const DequantProblem d{xp, M, K, N, group_size, w, scale.data(), offset.data(), half, s_tile, s_group, y};
        dequant_gemm(d);
        for (int64_t m = 0; act_int8 && m < M; ++m)
          for (int64_t n = 0; n < N; ++n) y[m * N + n] *= row_scale[m];
        return;
      }
      if (group_size % 32 == 0 && K % 32 == 0) {  // ~3-8% faster than the general loop below
        const int64_t NB = K / 32;
        std::vector<int8_t> panel(NB * M * 64);
        std::vector<float> meta(NB * M * 4);
        vnni32_panel(xp, M, K, act_int8, panel.data(), meta.data());
        Vnni32 p{M, K, group_size / 32, w, scale.data(), offset.data(), half, s_tile, s_group, panel.data(), meta.data(),
                 y, N};
        {
          // Work items of consecutive tiles, ~4 per core: each thread then streams (and
          // prefetches) contiguous weights. Single tiles interleaved the two threads' streams:
          // 120 calls at M = 1, 2 threads: 3.84 -> 3.36-3.48 ms (per-call tiles / 2, 4, 8 items).
          static const int64_t items = 4 * std::max<int64_t>(1, std::thread::hardware_concurrency());
          const int64_t tiles = N / kCols;
          p.per_chunk = std::max<int64_t>(1, (tiles + items - 1) / items);
        }
        if (act_int8)
          vnni32_gemm<1>(p);
        else
          vnni32_gemm<2>(p);
        for (int64_t m = 0; act_int8 && m < M; ++m)
          for (int64_t n = 0; n < N; ++n) y[m * N + n] *= row_scale[m];
        return;
      }
      const int64_t NB = (K + block - 1) / block;
      std::vector<float> xsum(M * G, 0.f), bscale;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t ke = std::min(K, (g + 1) * group_size);
          int64_t k = g * group_size;
          F32 acc = zero_f();
          for (; k + 16 <= ke; k += 16) acc = add_f(acc, load_f(xp + m * K + k));
          float s = reduce_add_f(acc);
          for (; k < ke; ++k) s += xp[m * K + k];
          xsum[m * G + g] = s;
        }
      std::vector<int8_t> xlo(M * K), xhi;
      std::vector<int32_t> bsum8;
      if (act_int8) {
        for (int64_t i = 0; i < M * K; ++i) xlo[i] = static_cast<int8_t>(xp[i]);
      } else {
        xhi.resize(M * K);
        bscale.resize(M * NB);
        bsum8.resize(M * NB);
        split_rows_16bit(xp, M, K, block, NB, xhi.data(), xlo.data(), bscale.data(), bsum8.data());
      }
      VnniProblem p{M, K, N, G, group_size, block, NB, w, scale.data(), offset.data(), half, s_tile, s_group,
                    act_int8 ? nullptr : xhi.data(), xlo.data(), act_int8 ? nullptr : bscale.data(), act_int8 ? nullptr : bsum8.data(), xsum.data(), y};
      if (act_int8)
        vnni_gemm<1>(p);
      else
        vnni_gemm<2>(p);
#endif
    }
    if (act_int8)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) y[m * N + n] *= row_scale[m];
  });
  return {out};
}

// The weight's layout from its rank: [R, N] row-major or [N / 32, R, 32] packed column tiles
// (R = K rows, or K / 2 byte rows for int4). Sets K, N and the Problem's strides.
template <Kind KIND>
void weight_layout(const paddle::Tensor& weight, int64_t* K, int64_t* N, int64_t* row_bytes, int64_t* tile_bytes) {
  const int64_t rows_per_weight_row = KIND == Kind::kInt4 ? 2 : 1;
  const auto& shape = weight.shape();
  if (shape.size() == 3) {
    PD_CHECK(shape[2] == kCols, "a packed weight is [N / 32, rows, 32], got last axis ", shape[2]);
    *K = shape[1] * rows_per_weight_row;
    *N = shape[0] * kCols;
    *row_bytes = kCols * kElem<KIND>;
    *tile_bytes = shape[1] * kCols * kElem<KIND>;
  } else {
    PD_CHECK(shape.size() == 2, "weight must be [rows, N] or packed [N / 32, rows, 32]");
    *K = shape[0] * rows_per_weight_row;
    *N = shape[1];
    *row_bytes = shape[1] * kElem<KIND>;
    *tile_bytes = kCols * kElem<KIND>;
  }
}

template <Kind KIND>
std::vector<paddle::Tensor> run(const paddle::Tensor& x_in, const paddle::Tensor& weight, const paddle::Tensor& scale,
                                const paddle::Tensor* offset, int64_t group_size, bool act_int8) {
  int64_t K, N, row_bytes, tile_bytes;
  weight_layout<KIND>(weight, &K, &N, &row_bytes, &tile_bytes);
  PD_CHECK(x_in.dtype() == paddle::DataType::FLOAT32, "x must be float32");
  PD_CHECK(x_in.shape().back() == K, "x's last axis (", x_in.shape().back(), ") must equal the weight's K (", K, ")");
  PD_CHECK(scale.dtype() == paddle::DataType::FLOAT32 && scale.shape().size() == 2 && scale.shape()[1] == N,
           "scale must be float32 [G, N]");
  PD_CHECK(group_size >= 1, "group_size must be positive");
  const int64_t G = (K + group_size - 1) / group_size;
  PD_CHECK(scale.shape()[0] == G, "scale has ", scale.shape()[0], " groups; K=", K, " in groups of ", group_size,
           " needs ", G);
  if (KIND == Kind::kInt4) PD_CHECK(group_size % 2 == 0, "int4 groups must hold an even number of rows");
  if (offset != nullptr)
    PD_CHECK(offset->shape() == scale.shape() && offset->dtype() == paddle::DataType::FLOAT32,
             "offset must be float32 shaped like scale");
  auto out = fd_graph::empty(out_shape(x_in.shape(), N), paddle::DataType::FLOAT32);
  const bool has_offset = offset != nullptr;
  const paddle::Tensor offset_t = has_offset ? *offset : paddle::Tensor();
  const char* op = KIND == Kind::kInt8 ? "fd_int8_linear" : KIND == Kind::kInt4 ? "fd_int4_linear" : "fd_fp8_linear";
  fd_graph::run(op, {&x_in, &weight, &scale, &offset_t}, {&out}, [=]() mutable {
    const paddle::Tensor x = x_in.contiguous();
    const int64_t M = K > 0 ? x.numel() / K : 0;
    std::vector<float> xq, row_scale;
    const float* xp = x.data<float>();
    if (act_int8) {
      xq.resize(M * K);
      row_scale.resize(M);
      quantize_rows(xp, M, K, xq.data(), row_scale.data());
      xp = xq.data();
    }
    Problem p{xp,
              M,
              K,
              N,
              static_cast<const uint8_t*>(weight.data()),
              scale.data<float>(),
              has_offset ? offset_t.data<float>() : nullptr,
              nullptr,
              G,
              group_size,
              out.data<float>(),
              row_bytes,
              tile_bytes};
    gemm<KIND>(p);
    if (act_int8) {
      float* y = out.data<float>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) y[m * N + n] *= row_scale[m];
    }
  });
  return {out};
}

}  // namespace

std::vector<paddle::Tensor> Int8Linear(const paddle::Tensor& x, const paddle::Tensor& weight,
                                       const paddle::Tensor& scale, int64_t group_size, bool act_int8) {
  PD_CHECK(weight.dtype() == paddle::DataType::INT8, "weight must be int8 [K, N]");
  return run<Kind::kInt8>(x, weight, scale, nullptr, group_size, act_int8);
}

std::vector<paddle::Tensor> Int4Linear(const paddle::Tensor& x, const paddle::Tensor& weight,
                                       const paddle::Tensor& scale, const paddle::Tensor& offset, int64_t group_size,
                                       bool act_int8) {
  PD_CHECK(weight.dtype() == paddle::DataType::UINT8, "weight must be uint8 [K / 2, N] (two int4 per byte)");
  if (weight.shape().size() == 4) return run_int4_vnni(x, weight, scale, offset, group_size, act_int8);
  return run<Kind::kInt4>(x, weight, scale, &offset, group_size, act_int8);
}

std::vector<paddle::Tensor> Fp8Linear(const paddle::Tensor& x, const paddle::Tensor& weight,
                                      const paddle::Tensor& scale, int64_t group_size) {
  PD_CHECK(weight.dtype() == paddle::DataType::FLOAT8_E4M3FN, "weight must be float8_e4m3fn [K, N]");
  return run<Kind::kFp8>(x, weight, scale, nullptr, group_size, false);
}

// y[M, N] = x[M, K] @ W[K, N] for float32 W: the same tiles without scales. Paddle's MKL
// sgemm reads a decode step's weights at ~16 GB/s from one thread; this loop streams them
// with both cores.
std::vector<paddle::Tensor> F32Linear(const paddle::Tensor& x_in, const paddle::Tensor& weight) {
  PD_CHECK(weight.dtype() == paddle::DataType::FLOAT32, "weight must be float32");
  PD_CHECK(x_in.dtype() == paddle::DataType::FLOAT32, "x must be float32");
  int64_t K, N, row_bytes, tile_bytes;
  weight_layout<Kind::kF32>(weight, &K, &N, &row_bytes, &tile_bytes);
  PD_CHECK(x_in.shape().back() == K, "x's last axis (", x_in.shape().back(), ") must equal the weight's K (", K, ")");
  auto out = fd_graph::empty(out_shape(x_in.shape(), N), paddle::DataType::FLOAT32);
  fd_graph::run("fd_f32_linear", {&x_in, &weight}, {&out}, [=]() mutable {
    const paddle::Tensor x = x_in.contiguous();
    const int64_t M = K > 0 ? x.numel() / K : 0;
    Problem p{x.data<float>(), M, K, N, static_cast<const uint8_t*>(weight.data()), nullptr, nullptr, nullptr, 1,
              std::max<int64_t>(K, 1), out.data<float>(), row_bytes, tile_bytes};
    gemm<Kind::kF32>(p);
  });
  return {out};
}

// fd_f32_linear_silu(x [..., K], W packed [2I / 32, K, 32]) -> silu(x @ W[:, :I]) * (x @ W[:, I:])
// [..., I], for a merged gate/up projection whose halves are whole tiles (I % 32 == 0): the
// SwiGLU of fd_f32_linear's product without the product going through memory. A work item is a
// gate tile t and its up tile t + I / 32: a panel of rows at a time, both tiles' sums go to a
// small buffer of the thread (L1) with fd_f32_linear's own loop and row blocks (panels are
// whole blocks of rows, so each row gets the same accumulation chain as in gemm), and only
// silu_mul16 of them (fd_silu_mul's formula) is written. The same bits as fd_f32_linear then
// fd_silu_mul. What it saves: the [M, 2I] product written and read back (25 MB for a 2,048-token
// prompt at SmolLM2's I = 1,536, mapped and zeroed page by page on each call) and the SwiGLU
// op's own pass.
constexpr int64_t kSiluPanelRows = 96;  // a multiple of kRowsFor (8 with AVX-512, 6 with AVX2): gemm's row blocks
static_assert(kSiluPanelRows % kRowsFor<Kind::kF32> == 0, "panels must be whole row blocks");

struct F32SiluJob {
  const float* x;
  int64_t M, K, I;
  const uint8_t* w;
  int64_t tile_bytes;
  float* out;
};

void f32_silu_tile_pair(void* ctx, int64_t t) {
  const F32SiluJob& j = *static_cast<const F32SiluJob*>(ctx);
  const int64_t K = j.K, half_tiles = j.I / kCols;
  thread_local fd_amx::TileBuffer<float> buf;  // [panel rows, 64]: gate sums, then up sums
  const int64_t panel = std::min(j.M, kSiluPanelRows);
  if (buf.size() < static_cast<size_t>(panel * 2 * kCols)) buf.resize(panel * 2 * kCols);
  for (int64_t m0 = 0; m0 < j.M; m0 += kSiluPanelRows) {
    const int64_t rows = std::min(kSiluPanelRows, j.M - m0);
    for (int half = 0; half < 2; ++half) {
      // One tile as a [rows, 32] problem (tile 0 of a one-tile weight) writing columns
      // [32 half, 32 half + 32) of buf, with gemm's choice for a step of j.M rows.
      const Problem q{j.x + m0 * K, rows, K, 2 * kCols, j.w + (t + half * half_tiles) * j.tile_bytes, nullptr, nullptr,
                      nullptr, 1, std::max<int64_t>(K, 1), buf.data() + half * kCols, kCols * kElem<Kind::kF32>, 0};
      tile_rows<Kind::kF32>(q, 0, j.M <= kWholeTileRowsMax);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* g = buf.data() + r * 2 * kCols;
      float* o = j.out + (m0 + r) * j.I + t * kCols;
      for (int64_t c = 0; c < kCols; c += 16)
        fd_kernels::store16(o + c, fd_kernels::silu_mul16(load16(g + c), load16(g + kCols + c)));
    }
  }
}

std::vector<paddle::Tensor> F32LinearSilu(const paddle::Tensor& x_in, const paddle::Tensor& weight) {
  PD_CHECK(weight.dtype() == paddle::DataType::FLOAT32 && weight.shape().size() == 3,
           "weight must be a packed float32 [N / 32, K, 32]");
  PD_CHECK(x_in.dtype() == paddle::DataType::FLOAT32, "x must be float32");
  int64_t K, N, row_bytes, tile_bytes;
  weight_layout<Kind::kF32>(weight, &K, &N, &row_bytes, &tile_bytes);
  PD_CHECK(weight.shape()[0] % 2 == 0, "the gate and up halves must be whole 32-column tiles (", N, " columns)");
  PD_CHECK(x_in.shape().back() == K, "x's last axis (", x_in.shape().back(), ") must equal the weight's K (", K, ")");
  auto out = fd_graph::empty(out_shape(x_in.shape(), N / 2), paddle::DataType::FLOAT32);
  fd_graph::run("fd_f32_linear_silu", {&x_in, &weight}, {&out}, [=]() mutable {
    const paddle::Tensor x = x_in.contiguous();
    const int64_t M = K > 0 ? x.numel() / K : 0;
    F32SiluJob job{x.data<float>(), M, K, N / 2, static_cast<const uint8_t*>(weight.data()), tile_bytes,
                   out.data<float>()};
    if (M > 0) fd_kernels::Pool::instance().run(N / 2 / kCols, f32_silu_tile_pair, &job);
  });
  return {out};
}

namespace fd_kernels {

bool f32_linear_two_chains(int64_t m, int64_t M) {
  constexpr int64_t R = kRowsFor<Kind::kF32>;
  const int64_t rest = M % R;  // gemm's last tile holds the rest rows; all others hold R
  return m >= M - rest && two_chains_for(static_cast<int>(rest));
}

void f32_linear_tile(const float* x, int64_t rows, int64_t K, const float* w_packed, int64_t t, bool two_chains,
                     float* y) {
  const float* w_tile = w_packed + t * K * kCols;
  if (!two_chains) {
    // A row's one-chain sums do not depend on the tile geometry: the register file's serves.
    f32_tile_rows_one_chain(x, rows, K, w_tile, 0, kCols, y);
    return;
  }
  PD_CHECK(rows <= 2, "f32_linear_tile: two accumulation chains are used by tiles of 1-2 rows only");
  // N = 32 and n0 = 0 with the weights of tile t: y is [rows, 32] and the loop is gemm's own.
  constexpr int64_t kRowBytes = kCols * kElem<Kind::kF32>;
  const Problem p{x, rows, K, kCols, reinterpret_cast<const uint8_t*>(w_tile), nullptr, nullptr, nullptr, 1,
                  std::max<int64_t>(K, 1), y, kRowBytes, 0};
  if (rows == 2) tile<2, Kind::kF32, true>(p, 0, 0);
  if (rows == 1) tile<1, Kind::kF32, true>(p, 0, 0);
}

float* tile_buffer(int64_t K) {
  thread_local LineBuffer<float> buf;  // 64-byte aligned (line_buffer.h)
  const size_t need = static_cast<size_t>(std::max<int64_t>(K, 1) * kCols);
  if (buf.size() < need) buf.resize(need);
  return buf.data();
}

void f32_tile_rows_one_chain(const float* x, int64_t M, int64_t K, const float* w_tile, int64_t t, int64_t N,
                             float* y) {
  // The tile as a one-tile packed weight: tile_bytes 0, so column n of tile t reads w_tile's
  // column n % 32.
  constexpr int64_t kRowBytes = kCols * kElem<Kind::kF32>;
  const Problem p{x, M, K, N, reinterpret_cast<const uint8_t*>(w_tile), nullptr, nullptr, nullptr, 1,
                  std::max<int64_t>(K, 1), y, kRowBytes, 0};
  constexpr int R = kRowsFor<Kind::kF32>;
  static_assert(R <= 8, "the remainder switch below covers blocks of up to 8 rows");
  for (int64_t n0 = t * kCols; n0 < (t + 1) * kCols; n0 += 16 * kTileVecs) {
    int64_t m = 0;
    for (; m + R <= M; m += R) tile<R, Kind::kF32, false, kTileVecs>(p, m, n0);
    switch (M - m) {
      case 7: tile<7, Kind::kF32, false, kTileVecs>(p, m, n0); break;
      case 6: tile<6, Kind::kF32, false, kTileVecs>(p, m, n0); break;
      case 5: tile<5, Kind::kF32, false, kTileVecs>(p, m, n0); break;
      case 4: tile<4, Kind::kF32, false, kTileVecs>(p, m, n0); break;
      case 3: tile<3, Kind::kF32, false, kTileVecs>(p, m, n0); break;
      case 2: tile<2, Kind::kF32, false, kTileVecs>(p, m, n0); break;
      case 1: tile<1, Kind::kF32, false, kTileVecs>(p, m, n0); break;
      default: break;
    }
  }
}

}  // namespace fd_kernels

int64_t out_features(const std::vector<int64_t>& w) { return w.size() >= 3 ? w[0] * kCols : w[1]; }

std::vector<std::vector<int64_t>> Shape2(const std::vector<int64_t>& x, const std::vector<int64_t>& w) {
  return {out_shape(x, out_features(w))};
}

std::vector<paddle::DataType> Float2(const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

std::vector<std::vector<int64_t>> Shape3(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                         const std::vector<int64_t>&) {
  return {out_shape(x, out_features(w))};
}

std::vector<std::vector<int64_t>> Shape4(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                         const std::vector<int64_t>&, const std::vector<int64_t>&) {
  return {out_shape(x, out_features(w))};
}

std::vector<paddle::DataType> Float3(const paddle::DataType&, const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

std::vector<paddle::DataType> Float4(const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
                                     const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(fd_int8_linear)
    .Inputs({"X", "Weight", "Scale"})
    .Outputs({"Out"})
    .Attrs({"group_size: int64_t", "act_int8: bool"})
    .SetKernelFn(PD_KERNEL(Int8Linear))
    .SetInferShapeFn(PD_INFER_SHAPE(Shape3))
    .SetInferDtypeFn(PD_INFER_DTYPE(Float3));

PD_BUILD_OP(fd_int4_linear)
    .Inputs({"X", "Weight", "Scale", "Offset"})
    .Outputs({"Out"})
    .Attrs({"group_size: int64_t", "act_int8: bool"})
    .SetKernelFn(PD_KERNEL(Int4Linear))
    .SetInferShapeFn(PD_INFER_SHAPE(Shape4))
    .SetInferDtypeFn(PD_INFER_DTYPE(Float4));

PD_BUILD_OP(fd_fp8_linear)
    .Inputs({"X", "Weight", "Scale"})
    .Outputs({"Out"})
    .Attrs({"group_size: int64_t"})
    .SetKernelFn(PD_KERNEL(Fp8Linear))
    .SetInferShapeFn(PD_INFER_SHAPE(Shape3))
    .SetInferDtypeFn(PD_INFER_DTYPE(Float3));

PD_BUILD_OP(fd_f32_linear)
    .Inputs({"X", "Weight"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(F32Linear))
    .SetInferShapeFn(PD_INFER_SHAPE(Shape2))
    .SetInferDtypeFn(PD_INFER_DTYPE(Float2));

std::vector<std::vector<int64_t>> SiluShape2(const std::vector<int64_t>& x, const std::vector<int64_t>& w) {
  return {out_shape(x, out_features(w) / 2)};
}

PD_BUILD_OP(fd_f32_linear_silu)
    .Inputs({"X", "W"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(F32LinearSilu))
    .SetInferShapeFn(PD_INFER_SHAPE(SiluShape2))
    .SetInferDtypeFn(PD_INFER_DTYPE(Float2));
