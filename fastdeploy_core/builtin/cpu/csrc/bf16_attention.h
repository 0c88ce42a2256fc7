// The bfloat16 multiplies of the tiled attention (paged_attention.cc) over a bfloat16 KV cache
// (--kv-cache-dtype bfloat16).
//
// Formula. Over a bfloat16 cache the attention multiplies bfloat16 by bfloat16 and adds in
// float32, as vLLM's and flash-attention's bfloat16 kernels do: each query row (already scaled)
// is rounded to bfloat16; a key tile's scores q . k are exact products summed in float32; the
// online softmax runs in float32 (maximum, exp, sums); the tile's weights exp(s - m) are rounded
// to bfloat16 after they were added to the row's sum, and the weighted values are exact products
// summed in float32. Rounding is to nearest, ties to even. The running maximum m is kept on the
// multiples of ln 2 (the smallest one >= the scores seen): rescaling by exp(m_old - m_new) is
// then a power of two, which commutes with rounding, so every weight is rounded as
// bf16(exp(s - M)) with M = ln 2 * ceil(max s / ln 2) over the row's keys, whatever the tiles
// and splits; the reference formula (ReferenceOps.paged_attention) is that, up to float32
// rounding of exp and the scores.
//
// Two paths compute that formula; they add in different orders, so they agree to float32
// rounding, not bit for bit:
//   dot   (AVX-512 BF16, vdpbf16ps): scores from the queries packed as k pairs against one
//         broadcast key pair (wide items) or whole bfloat16 rows (narrow items); values from the
//         weights packed as key pairs against the tile's value rows interleaved two by two. The
//         cache is never widened: half the bytes of a float32 cache, half the multiply-adds.
//   widen (any CPU): the tile's key and value rows widened to float32 and the float32 tile code
//         run on the rounded queries and rounded weights (the same products, exact in float32).
// The path is chosen per call (0: the CPU's best, 1: widen, 2: dot, an error without AVX-512
// BF16); the dot code is compiled for AVX-512 BF16 through a target attribute, so the library
// builds on compilers' default targets too.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_features.h"
#include "vector_math.h"

namespace fd_bf16_attention {

using fd_kernels::f32x16;
using fd_kernels::u32x16;

inline bool cpu_has_dot() { return fd_kernels::cpu_has_bf16_dot(); }

// The smallest multiple of ln 2 >= x, lane by lane (-inf stays -inf).
inline f32x16 ln2_ceiling(f32x16 x) {
  constexpr float kLog2e = 1.44269504088896340736f, kLn2 = 0.693147180559945309417f;
#if defined(__AVX512F__)
  // ceil as one rounding instruction (toward +inf, exact like std::ceil; NaN stays NaN)
  const f32x16 up = (f32x16)_mm512_roundscale_ps((__m512)(x * kLog2e), _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
  return fd_kernels::select(x == -__builtin_inff(), x, up * kLn2);
#else
  f32x16 r;
  for (int i = 0; i < 16; ++i) r[i] = x[i] == -__builtin_inff() ? x[i] : std::ceil(x[i] * kLog2e) * kLn2;
  return r;
#endif
}

// The float32 bits of x rounded to bfloat16 (nearest, ties to even; low half zero); a NaN stays
// a quiet NaN.
inline uint32_t round_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u | 0x00400000u) & 0xffff0000u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}

inline float round_float(float x) {
  const uint32_t u = round_bits(x);
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// 16 floats rounded the same way (round_float lane by lane: vector_math.h's round_bf16_lanes).
inline f32x16 round_floats16(f32x16 x) {
  return fd_kernels::bitcast<f32x16>(fd_kernels::round_bf16_lanes(fd_kernels::bitcast<u32x16>(x)));
}

// 16 weights (finite, >= 0: exp of a difference) rounded the same way.
inline u32x16 round_bits16(const float* p) {
  const u32x16 u = fd_kernels::load<u32x16>(reinterpret_cast<const uint32_t*>(p));
  return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}

// Weights st[j * mp + r] (j < nk) rounded in place (the widen path).
inline void round_weights(float* st, int64_t nk, int64_t mp) {
  for (int64_t i = 0; i < nk * mp; i += 16) {
    const u32x16 r = round_bits16(st + i);
    fd_kernels::store(reinterpret_cast<uint32_t*>(st + i), r);
  }
}

// Weights as key pairs: pp[jp * mp + r] = bf16(st[2 jp][r]) | bf16(st[2 jp + 1][r]) << 16, a
// missing odd key's weight 0.
inline void pack_weight_pairs(const float* st, int64_t nk, int64_t mp, uint32_t* pp) {
  for (int64_t jp = 0; 2 * jp < nk; ++jp) {
    for (int64_t rv = 0; rv < mp; rv += 16) {
      const u32x16 lo = round_bits16(st + 2 * jp * mp + rv) >> 16;
      const u32x16 hi = 2 * jp + 1 < nk ? round_bits16(st + (2 * jp + 1) * mp + rv) : u32x16{};
      const u32x16 pair = lo | hi;
      fd_kernels::store(pp + jp * mp + rv, pair);
    }
  }
}

// Value rows as key pairs: vp[jp * d + c] = v[2 jp][c] | v[2 jp + 1][c] << 16 (rows at
// v16 + off[j]), a missing odd row 0.
inline void pack_value_pairs(const uint16_t* v16, const int64_t* off, int64_t nk, int64_t d, uint32_t* vp) {
  for (int64_t jp = 0; 2 * jp < nk; ++jp) {
    const uint16_t* a = v16 + off[2 * jp];
    const uint16_t* b = 2 * jp + 1 < nk ? v16 + off[2 * jp + 1] : nullptr;
    uint32_t* dst = vp + jp * d;
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= d; c += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c)));
      const __m512i hi = b ? _mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c))), 16)
                           : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + c, _mm512_or_si512(lo, hi));
    }
#endif
    for (; c < d; ++c) dst[c] = a[c] | (b ? static_cast<uint32_t>(b[c]) << 16 : 0u);
  }
}

// Rounded queries (float32 values qr[r * d + c] that are bfloat16) as k pairs, transposed:
// qp[i * mp + r] = q_r[2 i] | q_r[2 i + 1] << 16 for every padded row r < mp.
inline void pack_query_pairs(const float* qr, int64_t mp, int64_t d, uint32_t* qp) {
  // 16 rows x 16 pairs at a time: each row's pairs in a vector, the 16 vectors transposed, each
  // then one pair of the 16 rows (a store per 16 values instead of one per value).
  const int64_t blocked = mp % 16 == 0 ? d / 32 * 16 : 0;
  for (int64_t r0 = 0; r0 < mp && blocked > 0; r0 += 16)
    for (int64_t i0 = 0; i0 < blocked; i0 += 16) {
      u32x16 v[16];
      for (int k = 0; k < 16; ++k) {
        const float* row = qr + (r0 + k) * d + 2 * i0;
        u32x16 even, odd;
        fd_kernels::deinterleave(fd_kernels::load<u32x16>(reinterpret_cast<const uint32_t*>(row)),
                                 fd_kernels::load<u32x16>(reinterpret_cast<const uint32_t*>(row + 16)), &even, &odd);
        v[k] = (even >> 16u) | (odd & 0xffff0000u);
      }
      fd_kernels::transpose16(v);
      for (int c = 0; c < 16; ++c) fd_kernels::store(qp + (i0 + c) * mp + r0, v[c]);
    }
  for (int64_t r = 0; r < mp; ++r) {
    for (int64_t i = blocked; i < d / 2; ++i) {
      uint32_t a, b;
      std::memcpy(&a, qr + r * d + 2 * i, 4);
      std::memcpy(&b, qr + r * d + 2 * i + 1, 4);
      qp[i * mp + r] = (a >> 16) | (b & 0xffff0000u);
    }
  }
}

// Rounded queries as bfloat16 rows: qb[r * d + c].
inline void pack_query_rows(const float* qr, int64_t m, int64_t d, uint16_t* qb) {
  for (int64_t i = 0; i < m * d; ++i) {
    uint32_t a;
    std::memcpy(&a, qr + i, 4);
    qb[i] = static_cast<uint16_t>(a >> 16);
  }
}

#if defined(__x86_64__)
#define FD_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512bf16")))

// Scores st[j * mp + r] = q_r . key_j, wide items: 4 keys x NV vectors of 16 rows per pass, one
// key pair (a 32-bit word of the cached row) broadcast against NV vectors of query pairs.
template <int NV>
FD_BF16_DOT void scores_wide_pass(const uint32_t* qp, int64_t mp, int64_t rv0, const uint16_t* k16,
                                  const int64_t* off, int64_t nk, int64_t d, float* st) {
  for (int64_t j0 = 0; j0 < nk; j0 += 4) {
    const int64_t nj = std::min<int64_t>(4, nk - j0);
    const uint32_t* kr[4];
    for (int64_t jj = 0; jj < 4; ++jj) kr[jj] = reinterpret_cast<const uint32_t*>(k16 + off[j0 + std::min(jj, nj - 1)]);
    __m512 acc[4][NV];
    for (int jj = 0; jj < 4; ++jj)
      for (int n = 0; n < NV; ++n) acc[jj][n] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d / 2; ++i) {
      __m512bh qv[NV];
      for (int n = 0; n < NV; ++n) qv[n] = (__m512bh)_mm512_loadu_si512(qp + i * mp + (rv0 + n) * 16);
      for (int jj = 0; jj < 4; ++jj) {
        uint32_t word;
        std::memcpy(&word, kr[jj] + i, 4);
        const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
        for (int n = 0; n < NV; ++n) acc[jj][n] = _mm512_dpbf16_ps(acc[jj][n], qv[n], b);
      }
    }
    for (int64_t jj = 0; jj < nj; ++jj)
      for (int n = 0; n < NV; ++n) _mm512_storeu_ps(st + (j0 + jj) * mp + (rv0 + n) * 16, acc[jj][n]);
  }
}

inline void scores_wide(const uint32_t* qp, int64_t mp, const uint16_t* k16, const int64_t* off, int64_t nk,
                        int64_t d, float* st) {
  const int64_t vectors = mp / 16;
  for (int64_t rv0 = 0; rv0 < vectors; rv0 += 4) {
    switch (std::min<int64_t>(4, vectors - rv0)) {
      case 1: scores_wide_pass<1>(qp, mp, rv0, k16, off, nk, d, st); break;
      case 2: scores_wide_pass<2>(qp, mp, rv0, k16, off, nk, d, st); break;
      case 3: scores_wide_pass<3>(qp, mp, rv0, k16, off, nk, d, st); break;
      default: scores_wide_pass<4>(qp, mp, rv0, k16, off, nk, d, st); break;
    }
  }
}

// Scores of narrow items (few rows, head size 32 * D32): each row's bfloat16 query against whole
// cached key rows, 16 keys' partial sums reduced together (sum16, paged_attention.cc).
template <int D32, typename Sum16>
FD_BF16_DOT void scores_narrow(const uint16_t* qb, int64_t m, int64_t mp, const uint16_t* k16, const int64_t* off,
                               int64_t nk, float* st, Sum16 sum16) {
  for (int64_t r = 0; r < m; ++r) {
    __m512bh qv[D32];
    for (int c = 0; c < D32; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qb + r * 32 * D32 + 32 * c);
    for (int64_t j0 = 0; j0 < nk; j0 += 16) {
      const int64_t n = std::min<int64_t>(16, nk - j0);
      f32x16 part[16];
      for (int64_t j = 0; j < n; ++j) {
        const uint16_t* row = k16 + off[j0 + j];
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < D32; ++c) acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(row + 32 * c));
        std::memcpy(&part[j], &acc, sizeof(acc));
      }
      for (int64_t j = n; j < 16; ++j) part[j] = f32x16{};
      const f32x16 s = sum16(part);
      for (int64_t j = 0; j < n; ++j) st[(j0 + j) * mp + r] = s[j];
    }
  }
}

// o[r] = o[r] * alpha[r] + sum over key pairs of (weight pair . value pair), rows r0 .. r0 + R - 1,
// head size 16 * D16, the R output rows in registers over the tile.
template <int D16, int R>
FD_BF16_DOT void pv_rows(const uint32_t* pp, int64_t mp, int64_t r0, const uint32_t* vp, int64_t pairs,
                         const float* alpha, float* o) {
  constexpr int64_t d = 16 * D16;
  __m512 acc[R][D16];
  for (int rr = 0; rr < R; ++rr)
    for (int c = 0; c < D16; ++c)
      acc[rr][c] = _mm512_mul_ps(_mm512_loadu_ps(o + (r0 + rr) * d + 16 * c), _mm512_set1_ps(alpha[r0 + rr]));
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512bh vv[D16];
    for (int c = 0; c < D16; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + jp * d + 16 * c);
    for (int rr = 0; rr < R; ++rr) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[jp * mp + r0 + rr]));
      for (int c = 0; c < D16; ++c) acc[rr][c] = _mm512_dpbf16_ps(acc[rr][c], w, vv[c]);
    }
  }
  for (int rr = 0; rr < R; ++rr)
    for (int c = 0; c < D16; ++c) _mm512_storeu_ps(o + (r0 + rr) * d + 16 * c, acc[rr][c]);
}

template <int D16>
void pv_fixed(const uint32_t* pp, int64_t m, int64_t mp, const uint32_t* vp, int64_t pairs, const float* alpha,
              float* o) {
  constexpr int R = D16 <= 4 ? 4 : 2;
  int64_t r0 = 0;
  for (; r0 + R <= m; r0 += R) pv_rows<D16, R>(pp, mp, r0, vp, pairs, alpha, o);
  for (; r0 < m; ++r0) pv_rows<D16, 1>(pp, mp, r0, vp, pairs, alpha, o);
}

// Whether scores_narrow() takes head size d (paged_attention.cc's switch).
inline bool narrow_takes(int64_t d) { return d == 32 || d == 64 || d == 96 || d == 128; }

// Whether pv() below takes head size d.
inline bool pv_takes(int64_t d) { return d == 16 || d == 32 || d == 48 || d == 64 || d == 128; }

inline void pv(const uint32_t* pp, int64_t m, int64_t mp, const uint32_t* vp, int64_t nk, int64_t d,
               const float* alpha, float* o) {
  const int64_t pairs = (nk + 1) / 2;
  switch (d) {
    case 16: return pv_fixed<1>(pp, m, mp, vp, pairs, alpha, o);
    case 32: return pv_fixed<2>(pp, m, mp, vp, pairs, alpha, o);
    case 48: return pv_fixed<3>(pp, m, mp, vp, pairs, alpha, o);
    case 64: return pv_fixed<4>(pp, m, mp, vp, pairs, alpha, o);
    case 128: return pv_fixed<8>(pp, m, mp, vp, pairs, alpha, o);
    default: break;
  }
}
#undef FD_BF16_DOT
#endif  // __x86_64__

}  // namespace fd_bf16_attention
