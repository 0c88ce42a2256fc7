// 16-lane int32 / float32 vectors for the integer dot-product kernels (the int4 layout of
// weight_only_gemm.cc), spelled for two instruction sets:
//
//   AVX-512 VNNI (+ BW): one zmm register per vector; dpbusd is vpdpbusd.
//   AVX2 (+ FMA, F16C): a pair of ymm registers; dpbusd is vpmaddubsw (u8 x s8 -> the sums of
//     adjacent pairs in int16) then vpmaddwd with ones (the int16 pairs -> int32) then an add.
//
// Both give the same integers: dpbusd / dot16 multiply codes in [0, 15] by int8 values, so a
// vpmaddubsw pair sum is at most 2 * 15 * 128 = 3840 and never saturates; dot_u8 takes full
// bytes another way (below); the float operations are the same lane by lane. FD_INT8_DOT is
// defined when one of the two is available (kernels.has_int8_dot mirrors the condition).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define FD_INT8_DOT 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FD_INT8_DOT 256
#endif

// A 16-bit code a (|a| <= kPieceMax) as two int8 pieces, a = 256 hi + lo: hi = (a + 128) >> 8
// = round(a / 256) in [-127, 127], lo = a - 256 hi in [-128, 127]. The 16-bit activations of
// fd_int4_linear (per block of 32) and fd_w8a8_linear's two pieces (per row); any build.
namespace fd_int8_pieces {
constexpr int kPieceMax = 32639;
inline int high_piece(int a) { return (a + 128) >> 8; }
}  // namespace fd_int8_pieces

#if defined(FD_INT8_DOT)
namespace fd_int8_dot {

#if FD_INT8_DOT == 512

typedef __m512i I32;
typedef __m512 F32;

inline I32 zero_i() { return _mm512_setzero_si512(); }
inline I32 set1_i(int32_t v) { return _mm512_set1_epi32(v); }
inline I32 load_i(const void* p) { return _mm512_loadu_si512(p); }
inline I32 and_i(I32 a, I32 b) { return _mm512_and_si512(a, b); }
inline I32 add_i(I32 a, I32 b) { return _mm512_add_epi32(a, b); }
inline I32 sub_i(I32 a, I32 b) { return _mm512_sub_epi32(a, b); }
inline I32 min_i(I32 a, I32 b) { return _mm512_min_epi32(a, b); }
inline I32 max_i(I32 a, I32 b) { return _mm512_max_epi32(a, b); }
inline I32 shl_i(I32 a, int n) { return _mm512_slli_epi32(a, n); }
inline I32 sar_i(I32 a, int n) { return _mm512_srai_epi32(a, n); }
inline I32 shr_i(I32 a, int n) { return _mm512_srli_epi32(a, n); }
// acc + the sums of 4 products u8 x s8 per int32 lane.
inline I32 dpbusd(I32 acc, I32 u8, I32 s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
// Short sums (see dot16 below): vpdpbusd accumulates in int32 directly.
inline I32 dot16(I32 acc, I32 u8, I32 s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
inline I32 widen16(I32 acc) { return acc; }
// acc + sum over each lane's 4 byte pairs of u8 x s8, for any u8 (see the AVX2 spelling).
inline I32 dot_u8(I32 acc, I32 u8, I32 s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
// Whether dot_u8 sums (u8 - 128) x s8 instead of u8 x s8.
constexpr bool kDotU8Centred = false;
inline int32_t reduce_add_i(I32 a) { return _mm512_reduce_add_epi32(a); }

inline F32 zero_f() { return _mm512_setzero_ps(); }
inline F32 set1_f(float v) { return _mm512_set1_ps(v); }
inline F32 load_f(const float* p) { return _mm512_loadu_ps(p); }
inline void store_f(float* p, F32 v) { _mm512_storeu_ps(p, v); }
inline F32 load_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline F32 add_f(F32 a, F32 b) { return _mm512_add_ps(a, b); }
inline F32 sub_f(F32 a, F32 b) { return _mm512_sub_ps(a, b); }
inline F32 mul_f(F32 a, F32 b) { return _mm512_mul_ps(a, b); }
inline F32 fmadd(F32 a, F32 b, F32 c) { return _mm512_fmadd_ps(a, b, c); }
inline F32 abs_f(F32 a) { return _mm512_abs_ps(a); }
inline F32 max_f(F32 a, F32 b) { return _mm512_max_ps(a, b); }
inline float reduce_add_f(F32 a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max_f(F32 a) { return _mm512_reduce_max_ps(a); }
inline F32 to_f(I32 a) { return _mm512_cvtepi32_ps(a); }
inline I32 xor_i(I32 a, I32 b) { return _mm512_xor_si512(a, b); }
inline F32 div_f(F32 a, F32 b) { return _mm512_div_ps(a, b); }
inline F32 min_f(F32 a, F32 b) { return _mm512_min_ps(a, b); }
// Round to nearest, ties to even (the default MXCSR mode), as std::nearbyint.
inline I32 round_i(F32 a) { return _mm512_cvtps_epi32(a); }
// The 16 lanes (each in [-128, 127]) as 16 bytes.
inline void store_bytes(int8_t* p, I32 a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a)); }

#else

struct I32 {
  __m256i lo, hi;
};
struct F32 {
  __m256 lo, hi;
};

inline I32 zero_i() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I32 set1_i(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline I32 load_i(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline I32 and_i(I32 a, I32 b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline I32 add_i(I32 a, I32 b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline I32 sub_i(I32 a, I32 b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
inline I32 min_i(I32 a, I32 b) { return {_mm256_min_epi32(a.lo, b.lo), _mm256_min_epi32(a.hi, b.hi)}; }
inline I32 max_i(I32 a, I32 b) { return {_mm256_max_epi32(a.lo, b.lo), _mm256_max_epi32(a.hi, b.hi)}; }
inline I32 shl_i(I32 a, int n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
inline I32 sar_i(I32 a, int n) { return {_mm256_srai_epi32(a.lo, n), _mm256_srai_epi32(a.hi, n)}; }
inline I32 shr_i(I32 a, int n) { return {_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)}; }
inline I32 dpbusd(I32 acc, I32 u8, I32 s8) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(_mm256_maddubs_epi16(u8.lo, s8.lo), ones)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(_mm256_maddubs_epi16(u8.hi, s8.hi), ones))};
}
// A short sum of products, kept in int16 lanes: acc16 + vpmaddubsw(u8, s8), the int32 lane's two
// int16 halves each holding its own pair sums; widen16 adds the halves into int32 (vpmaddwd with
// ones). One multiply instead of two per call (Zen 2 runs both on one pipe). Exact while each
// int16 lane stays within 2^15: with codes in [0, 15] and int8 values, at most 8 calls per
// widen16 (8 * 3840 < 32768). The empty asm pins each sum where it is written: without it GCC
// reassociates a tile's chain of adds, computes all of a block's products first and spills
// them to the stack (16 ymm registers); with it an int4 decode step's 120 projections took 5.6
// instead of 6.2 ms at one row, 6.5 instead of 7.9 at two (AVX2 EPYC 7002, 2026-12-03).
inline I32 dot16(I32 acc, I32 u8, I32 s8) {
  I32 r{_mm256_add_epi16(acc.lo, _mm256_maddubs_epi16(u8.lo, s8.lo)),
        _mm256_add_epi16(acc.hi, _mm256_maddubs_epi16(u8.hi, s8.hi))};
  __asm__("" : "+x"(r.lo), "+x"(r.hi));
  return r;
}
inline I32 widen16(I32 acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(acc.lo, ones), _mm256_madd_epi16(acc.hi, ones)};
}
// acc + sum over each lane's 4 byte pairs of (u8 - 128) x s8, for u8 in [1, 255] and s8 in
// [-127, 127] (the caller adds 128 sum s8 if it wants u8 x s8: kDotU8Centred). vpmaddubsw needs
// one unsigned operand and saturates int16 pair sums: u8 x s8 can reach 2 * 255 * 127. So the
// products are taken as |s8| x sign(s8)(u8 - 128), whose pair sums stay within 2 * 127 * 127.
inline I32 dot_u8(I32 acc, I32 u8, I32 s8) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  auto half = [&](__m256i a, __m256i u, __m256i s) __attribute__((always_inline)) {
    const __m256i q = _mm256_sign_epi8(_mm256_xor_si256(u, flip), s);
    return _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(s), q), ones));
  };
  return {half(acc.lo, u8.lo, s8.lo), half(acc.hi, u8.hi, s8.hi)};
}
constexpr bool kDotU8Centred = true;
inline int32_t reduce_add_i(I32 a) {
  const __m256i s = _mm256_add_epi32(a.lo, a.hi);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(t);
}

inline F32 zero_f() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F32 set1_f(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline F32 load_f(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store_f(float* p, F32 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline F32 load_half(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline F32 add_f(F32 a, F32 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F32 sub_f(F32 a, F32 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F32 mul_f(F32 a, F32 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F32 fmadd(F32 a, F32 b, F32 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F32 abs_f(F32 a) {
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, mask), _mm256_and_ps(a.hi, mask)};
}
inline F32 max_f(F32 a, F32 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float reduce8(__m256 s, bool take_max) {
  __m128 t = take_max ? _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1))
                      : _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 u = _mm_movehl_ps(t, t);
  t = take_max ? _mm_max_ps(t, u) : _mm_add_ps(t, u);
  const __m128 v = _mm_shuffle_ps(t, t, 1);
  return _mm_cvtss_f32(take_max ? _mm_max_ss(t, v) : _mm_add_ss(t, v));
}
inline float reduce_add_f(F32 a) { return reduce8(_mm256_add_ps(a.lo, a.hi), false); }
inline float reduce_max_f(F32 a) { return reduce8(_mm256_max_ps(a.lo, a.hi), true); }
inline F32 to_f(I32 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline I32 xor_i(I32 a, I32 b) { return {_mm256_xor_si256(a.lo, b.lo), _mm256_xor_si256(a.hi, b.hi)}; }
inline F32 div_f(F32 a, F32 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F32 min_f(F32 a, F32 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline I32 round_i(F32 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline void store_bytes(int8_t* p, I32 a) {
  // int32 -> int16 -> int8 with saturation (the values fit, so it equals truncation); packs work
  // per 128-bit lane, the permute puts the four int16 quarters back in order.
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), _MM_SHUFFLE(3, 1, 2, 0));
  const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
}

#endif

inline I32 set1_bytes(uint8_t v) { return set1_i(static_cast<int32_t>(0x01010101u * v)); }
// fd_int8_pieces' split, 16 codes at a time: the high pieces, and the low ones given them.
inline I32 high_piece(I32 a) { return sar_i(add_i(a, set1_i(128)), 8); }
inline I32 low_piece(I32 a, I32 hi) { return sub_i(a, shl_i(hi, 8)); }

}  // namespace fd_int8_dot
#endif  // FD_INT8_DOT
