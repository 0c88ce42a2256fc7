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
// the weight tensor; scales and offsets keep [G, N].
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
// (|x|max / 127, round half away from zero, as paddle.round): W8A8 / W4A8. The products of
// integer-valued floats are exact; the sums are float32.
//
// Vectors use GCC vector extensions (16 floats): with -march=native they compile to AVX-512
// registers, or to pairs of AVX2 registers on AVX2-only machines.
//
// Threads (thread_pool.h) split the output columns into chunks of one or two tiles.

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

#include "paddle/extension.h"
#include "thread_pool.h"

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

enum class Kind { kInt8, kInt4, kFp8, kF32 };

constexpr int64_t kCols = 32;  // output columns per tile: two vectors
constexpr int kRows = 4;       // rows of x per tile (8 for float32 weights: no widening, more FMAs per load)
template <Kind KIND>
constexpr int kRowsFor = KIND == Kind::kF32 ? 8 : kRows;

inline f32x16 load_f32(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_f32(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

// Byte -> int32 widening uses intrinsics: GCC lowers __builtin_convertvector of 16 bytes to
// 16 ints as scalar inserts, which made the int8 loop ~10x slower.
inline i32x16 widen_bytes(const void* p, bool is_signed) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return (i32x16)(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b0 = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  const __m128i b1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const char*>(p) + 8));
  const __m256i lo = is_signed ? _mm256_cvtepi8_epi32(b0) : _mm256_cvtepu8_epi32(b0);
  const __m256i hi = is_signed ? _mm256_cvtepi8_epi32(b1) : _mm256_cvtepu8_epi32(b1);
  i32x16 r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
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

inline f32x16 widen_i8(const uint8_t* p) { return __builtin_convertvector(widen_bytes(p, true), f32x16); }

inline void widen_u4(const uint8_t* p, f32x16* lo, f32x16* hi) {
  const i32x16 w = widen_bytes(p, false);
  *lo = __builtin_convertvector(w & 15, f32x16);
  *hi = __builtin_convertvector(w >> 4, f32x16);
}

// float8 e4m3fn -> float32 exactly: a normal value moves its exponent from bias 7 to bias 127
// (add 120 to the exponent field); a subnormal one (exponent 0) is mantissa * 2^-9.
inline f32x16 widen_fp8(const uint8_t* p) {
  const i32x16 b = widen_bytes(p, false);
  const i32x16 magnitude = b & 0x7F;
  const i32x16 sign = (b & 0x80) << 24;
  const i32x16 normal = ((magnitude << 20) + (120 << 23)) | sign;
  const f32x16 tiny = __builtin_convertvector(magnitude, f32x16) * (1.0f / 512.0f);
  const i32x16 subnormal = (i32x16)tiny | sign;
  return (f32x16)((magnitude >> 3) == 0 ? subnormal : normal);
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
inline f32x16 load_w<Kind::kF32>(const uint8_t* row) { return load_f32(reinterpret_cast<const float*>(row)); }

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

// One tile: ROWS rows of x (starting at row m) times columns [n0, n0 + 32) of W.
template <int ROWS, Kind KIND>
void tile(const Problem& p, int64_t m, int64_t n0) {
  const int64_t K = p.K, N = p.N;
  const float* x = p.x + m * K;
  f32x16 total[ROWS][2];
  for (int r = 0; r < ROWS; ++r) total[r][0] = total[r][1] = f32x16{};
  for (int64_t g = 0; g < p.G; ++g) {
    f32x16 acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = f32x16{};
    const int64_t k_begin = g * p.group, k_end = std::min(K, k_begin + p.group);
    // With few rows the multiply-adds of consecutive k would form one dependency chain per
    // accumulator (4-cycle FMA latency); a second accumulator set lets two k run at once.
    constexpr bool kTwoChains = ROWS <= 2;
    f32x16 acc2[ROWS][2];
    for (int r = 0; r < ROWS; ++r) acc2[r][0] = acc2[r][1] = f32x16{};
    if constexpr (KIND == Kind::kInt4) {
      for (int64_t k = k_begin; k < k_end; k += 2) {
        const uint8_t* row = p.w + (n0 / kCols) * p.tile_bytes + (k / 2) * p.row_bytes;
        f32x16 lo0, hi0, lo1, hi1;
        widen_u4(row, &lo0, &hi0);
        widen_u4(row + 16, &lo1, &hi1);
        for (int r = 0; r < ROWS; ++r) {
          const float xa = x[r * K + k], xb = x[r * K + k + 1];
          acc[r][0] += xa * lo0;
          acc[r][1] += xa * lo1;
          if constexpr (kTwoChains) {
            acc2[r][0] += xb * hi0;
            acc2[r][1] += xb * hi1;
          } else {
            acc[r][0] += xb * hi0;
            acc[r][1] += xb * hi1;
          }
        }
      }
    } else {
      int64_t k = k_begin;
      if constexpr (kTwoChains) {
        for (; k + 1 < k_end; k += 2) {
          const uint8_t* row = p.w + (n0 / kCols) * p.tile_bytes + k * p.row_bytes;
          const f32x16 w0 = load_w<KIND>(row), w1 = load_w<KIND>(row + 16 * kElem<KIND>);
          const f32x16 v0 = load_w<KIND>(row + p.row_bytes), v1 = load_w<KIND>(row + p.row_bytes + 16 * kElem<KIND>);
          for (int r = 0; r < ROWS; ++r) {
            const float xa = x[r * K + k], xb = x[r * K + k + 1];
            acc[r][0] += xa * w0;
            acc[r][1] += xa * w1;
            acc2[r][0] += xb * v0;
            acc2[r][1] += xb * v1;
          }
        }
      }
      for (; k < k_end; ++k) {
        const uint8_t* row = p.w + (n0 / kCols) * p.tile_bytes + k * p.row_bytes;
        const f32x16 w0 = load_w<KIND>(row), w1 = load_w<KIND>(row + 16 * kElem<KIND>);
        for (int r = 0; r < ROWS; ++r) {
          const float xv = x[r * K + k];
          acc[r][0] += xv * w0;
          acc[r][1] += xv * w1;
        }
      }
    }
    if constexpr (kTwoChains) {
      for (int r = 0; r < ROWS; ++r) {
        acc[r][0] += acc2[r][0];
        acc[r][1] += acc2[r][1];
      }
    }
    if constexpr (KIND == Kind::kF32) {
      for (int r = 0; r < ROWS; ++r) {
        total[r][0] += acc[r][0];
        total[r][1] += acc[r][1];
      }
    } else {
      const f32x16 s0 = load_f32(p.scale + g * N + n0), s1 = load_f32(p.scale + g * N + n0 + 16);
      for (int r = 0; r < ROWS; ++r) {
        total[r][0] += acc[r][0] * s0;
        total[r][1] += acc[r][1] * s1;
      }
    }
    if (p.offset != nullptr) {
      const f32x16 o0 = load_f32(p.offset + g * N + n0), o1 = load_f32(p.offset + g * N + n0 + 16);
      for (int r = 0; r < ROWS; ++r) {
        const float xs = p.xsum[(m + r) * p.G + g];
        total[r][0] += xs * o0;
        total[r][1] += xs * o1;
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    store_f32(p.y + (m + r) * N + n0, total[r][0]);
    store_f32(p.y + (m + r) * N + n0 + 16, total[r][1]);
  }
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
    const Problem& q = *j.p;
    for (int64_t t = c * j.per_chunk; t < std::min(j.full_tiles, (c + 1) * j.per_chunk); ++t) {
      const int64_t n0 = t * kCols;
      int64_t m = 0;
      constexpr int R = kRowsFor<KIND>;
      for (; m + R <= q.M; m += R) tile<R, KIND>(q, m, n0);
      switch (q.M - m) {
        case 7: tile<7, KIND>(q, m, n0); break;
        case 6: tile<6, KIND>(q, m, n0); break;
        case 5: tile<5, KIND>(q, m, n0); break;
        case 4: tile<4, KIND>(q, m, n0); break;
        case 3: tile<3, KIND>(q, m, n0); break;
        case 2: tile<2, KIND>(q, m, n0); break;
        case 1: tile<1, KIND>(q, m, n0); break;
        default: break;
      }
    }
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
    for (int64_t k = 0; k < K; ++k) xq[m * K + k] = std::min(127.f, std::max(-127.f, std::round(x[m * K + k] / s)));
  }
}

std::vector<int64_t> out_shape(const std::vector<int64_t>& x_shape, int64_t n) {
  std::vector<int64_t> shape(x_shape.begin(), x_shape.end() - 1);
  shape.push_back(n);
  return shape;
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
  const paddle::Tensor x = x_in.contiguous();
  const int64_t M = K > 0 ? x.numel() / K : 0;
  auto out = paddle::empty(out_shape(x.shape(), N), paddle::DataType::FLOAT32, paddle::CPUPlace());
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
            offset != nullptr ? offset->data<float>() : nullptr,
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
// y[M, N] = x[M, K] @ W[K, N] for float32 W: the same tiles without scales.
std::vector<paddle::Tensor> F32Linear(const paddle::Tensor& x_in, const paddle::Tensor& weight) {
  PD_CHECK(weight.dtype() == paddle::DataType::FLOAT32, "weight must be float32");
  PD_CHECK(x_in.dtype() == paddle::DataType::FLOAT32, "x must be float32");
  int64_t K, N, row_bytes, tile_bytes;
  weight_layout<Kind::kF32>(weight, &K, &N, &row_bytes, &tile_bytes);
  PD_CHECK(x_in.shape().back() == K, "x's last axis (", x_in.shape().back(), ") must equal the weight's K (", K, ")");
  const paddle::Tensor x = x_in.contiguous();
  const int64_t M = K > 0 ? x.numel() / K : 0;
  auto out = paddle::empty(out_shape(x.shape(), N), paddle::DataType::FLOAT32, paddle::CPUPlace());
  Problem p{x.data<float>(), M, K, N, static_cast<const uint8_t*>(weight.data()), nullptr, nullptr, nullptr, 1,
            std::max<int64_t>(K, 1), out.data<float>(), row_bytes, tile_bytes};
  gemm<Kind::kF32>(p);
  return {out};
}

int64_t out_features(const std::vector<int64_t>& w) { return w.size() == 3 ? w[0] * kCols : w[1]; }

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
