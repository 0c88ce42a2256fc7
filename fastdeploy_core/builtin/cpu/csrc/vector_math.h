// 16-lane vectors and the vector math the cpu kernels share.
//
// With AVX-512 (the library is built with -march=native) a 16-lane vector is a GCC vector
// extension type, one zmm register. Without it GCC gives a 64-byte vector type no machine mode:
// such values live in memory, every broadcast is 16 scalar stores and accumulators are stored
// around every FMA (fd_f32_linear ran at ~2 GFLOP/s per thread on an AVX2 EPYC). There a 16-lane
// vector is Pair16, two 8-lane halves (one ymm register each) with the same operators, which GCC
// keeps in registers like any small struct (the same loop: ~20-45 GFLOP/s).
//
// The kernels use only what both spellings share: arithmetic, bitwise and comparison operators
// (with vectors or scalars), v[i], T{} for zero, and select / convert / bitcast below instead of
// vector ?:, __builtin_convertvector and vector casts. Lanes never mix in these operators, so a
// lane's float32 result is the same with either spelling.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace fd_kernels {

#if defined(__AVX512F__)

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// mask ? a : b lane by lane (mask lanes all ones or zero, as comparisons give).
template <class V>
inline V select(i32x16 mask, V a, V b) { return mask ? a : b; }

// Lane-wise value conversion (float -> int truncates toward zero).
template <class To, class From>
inline To convert(From v) { return __builtin_convertvector(v, To); }

// The same 64 bytes read as another lane type.
template <class To, class From>
inline To bitcast(From v) { return (To)v; }

#else

// 16 lanes of E as two 8-lane halves.
template <class E>
struct Pair16 {
  typedef E Half __attribute__((vector_size(32)));
  typedef int32_t Mask __attribute__((vector_size(32)));
  Half lo, hi;  // lanes 0-7, 8-15 (named members: GCC keeps them in registers, an array of two it did not)

  E operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
  // Lane i as an lvalue: GCC vector types alias their element type, and hi follows lo.
  E& operator[](int i) { return reinterpret_cast<E*>(&lo)[i]; }

// Friends defined in a class template are instantiated only when used: the bitwise ones only
// ever for integer lanes.
#define FD_PAIR_OP(op)                                                                                    \
  friend inline Pair16 operator op(Pair16 a, Pair16 b) { return {a.lo op b.lo, a.hi op b.hi}; } \
  friend inline Pair16 operator op(Pair16 a, E s) { return {a.lo op s, a.hi op s}; }                \
  friend inline Pair16 operator op(E s, Pair16 b) { return {s op b.lo, s op b.hi}; }                \
  Pair16& operator op##=(Pair16 b) { return *this = *this op b; }                                          \
  Pair16& operator op##=(E s) { return *this = *this op s; }
  FD_PAIR_OP(+)
  FD_PAIR_OP(-)
  FD_PAIR_OP(*)
  FD_PAIR_OP(/)
  FD_PAIR_OP(&)
  FD_PAIR_OP(|)
  FD_PAIR_OP(^)
  FD_PAIR_OP(<<)
  FD_PAIR_OP(>>)
#undef FD_PAIR_OP
  friend inline Pair16 operator-(Pair16 a) { return {-a.lo, -a.hi}; }

  // Comparisons give an int32 mask per lane (all ones or zero), as GCC vector comparisons do.
#define FD_PAIR_CMP(op)                                                                               \
  friend inline Pair16<int32_t> operator op(Pair16 a, Pair16 b) {                                     \
    return {(Mask)(a.lo op b.lo), (Mask)(a.hi op b.hi)};                                    \
  }                                                                                                   \
  friend inline Pair16<int32_t> operator op(Pair16 a, E s) { return {(Mask)(a.lo op s), (Mask)(a.hi op s)}; } \
  friend inline Pair16<int32_t> operator op(E s, Pair16 b) { return {(Mask)(s op b.lo), (Mask)(s op b.hi)}; }
  FD_PAIR_CMP(<)
  FD_PAIR_CMP(<=)
  FD_PAIR_CMP(>)
  FD_PAIR_CMP(>=)
  FD_PAIR_CMP(==)
  FD_PAIR_CMP(!=)
#undef FD_PAIR_CMP
};

typedef Pair16<float> f32x16;
typedef Pair16<int32_t> i32x16;
typedef Pair16<uint32_t> u32x16;

template <class V>
inline V select(i32x16 mask, V a, V b) {
  return {mask.lo ? a.lo : b.lo, mask.hi ? a.hi : b.hi};
}

template <class To, class From>
inline To convert(From v) {
  return {__builtin_convertvector(v.lo, typename To::Half), __builtin_convertvector(v.hi, typename To::Half)};
}

template <class To, class From>
inline To bitcast(From v) {
  return {(typename To::Half)v.lo, (typename To::Half)v.hi};
}

#endif

// The even and odd lanes of the 32 lanes a, b (a's first): even = a0 a2 .. a14 b0 .. b14.
template <class V>
inline void deinterleave(V a, V b, V* even, V* odd) {
#if defined(__AVX512F__)
  *even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  *odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  *even = {__builtin_shufflevector(a.lo, a.hi, 0, 2, 4, 6, 8, 10, 12, 14),
           __builtin_shufflevector(b.lo, b.hi, 0, 2, 4, 6, 8, 10, 12, 14)};
  *odd = {__builtin_shufflevector(a.lo, a.hi, 1, 3, 5, 7, 9, 11, 13, 15),
          __builtin_shufflevector(b.lo, b.hi, 1, 3, 5, 7, 9, 11, 13, 15)};
#endif
}

// x in every lane. (f32x16{} + x would cost an add per use: x + 0 is not x for x = -0, so the
// compiler keeps it, on the same ports as the FMAs.)
inline f32x16 splat(float x) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_set1_ps(x);
#else
  const f32x16::Half half = {x, x, x, x, x, x, x, x};
  return {half, half};
#endif
}

// Unaligned loads and stores (a pair moves half by half: one 64-byte copy of the struct went
// through the stack).
template <class V = f32x16, class E>
inline V load(const E* p) {
  V v;
#if defined(__AVX512F__)
  std::memcpy(&v, p, sizeof(v));
#else
  std::memcpy(&v.lo, p, sizeof(v.lo));
  std::memcpy(&v.hi, p + 8, sizeof(v.hi));
#endif
  return v;
}

template <class V, class E>
inline void store(E* p, V v) {
#if defined(__AVX512F__)
  std::memcpy(p, &v, sizeof(v));
#else
  std::memcpy(p, &v.lo, sizeof(v.lo));
  std::memcpy(p + 8, &v.hi, sizeof(v.hi));
#endif
}

inline f32x16 load16(const float* p) { return load<f32x16>(p); }

inline void store16(float* p, f32x16 v) { store(p, v); }

// How fd_argmax orders values: NaN reads as -inf, so it never wins over a number (greedy_head.cc
// reproduces fd_argmax's choice with the same rule).
inline float ordered(float v) { return v != v ? -__builtin_inff() : v; }

// The sum of v's 16 lanes.
inline float hsum(f32x16 v) {
#if defined(__AVX512F__)
  __m512 r;
  std::memcpy(&r, &v, sizeof(r));
  return _mm512_reduce_add_ps(r);  // a few shuffles instead of 16 dependent scalar adds
#else
  const f32x16::Half t = v.lo + v.hi;
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += t[i];
  return s;
#endif
}

// exp(x) for x <= 0 (softmax after subtracting the maximum), 16 lanes: x = n ln2 + r with
// |r| <= ln2 / 2 (n = x log2(e) rounded half away from zero), exp(r) by a degree-6 polynomial
// (relative error < 2e-7, as expf), times 2^n. Inputs below -87 give 0, NaN stays NaN. The
// scalar std::exp per score was most of a long prompt's attention time. Always inlined: a call
// (through the PLT, the vector returned in memory) cost a prompt's attention on tiles ~15% where
// the compiler chose one.
//
// With AVX-512 the same steps take 15 instructions instead of ~21: the clamp is one max, n's
// half with x's sign one ternary-logic op, the rounding one roundscale (toward zero), and 2^n one
// scalef instead of converting n to an integer and building the exponent bits. The results are
// the same bits for every x <= 88 (checked on every 7th float bit pattern from -120 to 88, and
// +-inf, NaN); a 2,048-token prompt's attention, 30 layers, float32 cache: ~4% less time.
__attribute__((always_inline)) inline f32x16 exp16(f32x16 x_in) {
  const f32x16 lo = splat(-87.f);
#if defined(__AVX512F__)
  const __m512 x = _mm512_max_ps((__m512)lo, (__m512)x_in);  // max(lo, NaN) is NaN (the second operand)
  const __m512i half = _mm512_set1_epi32(0x3f000000), sign = _mm512_set1_epi32(0x80000000);
  const __m512 signed_half = (__m512)_mm512_ternarylogic_epi32(sign, (__m512i)x, half, 0xEA);  // (sign & x) | half
  const __m512 n512 = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), signed_half),
                                           _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const f32x16 n = (f32x16)n512;
  const f32x16 r = (f32x16)x - n * 0.693359375f + n * 2.12194440e-4f;
#else
  const f32x16 x = select(x_in < lo, lo, x_in);
  const f32x16 n = convert<f32x16>(convert<i32x16>(x * 1.44269504f + select(x < 0.f, splat(-0.5f), splat(0.5f))));
  const f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
#endif
  f32x16 p = f32x16{} + 1.3888889e-3f;
  p = p * r + 8.3333333e-3f;
  p = p * r + 4.1666667e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
#if defined(__AVX512F__)
  const __m512 e = _mm512_scalef_ps((__m512)p, n512);
  return (f32x16)_mm512_maskz_mov_ps(_mm512_cmp_ps_mask((__m512)x_in, (__m512)lo, _CMP_NLT_UQ), e);  // x_in < lo: 0
#else
  const i32x16 bits = (convert<i32x16>(n) + 127) << 23;
  const f32x16 e = p * bitcast<f32x16>(bits);
  return select(x_in < lo, f32x16{}, e);
#endif
}

// 16 vectors of 16 32-bit lanes transposed in place: v[i][c] becomes v[c][i].
__attribute__((always_inline)) inline void transpose16(u32x16* v) {
#if defined(__AVX512F__)
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = (__m512i)v[i];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: rows 2i and 2i + 1 interleaved
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + k]: lane L holds column 4L + k of rows 4i .. 4i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k: lane L of r[k], r[4 + k], r[8 + k], r[12 + k]
    const __m512i u0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44), u1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44), w1 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
    v[k] = (u32x16)_mm512_shuffle_i32x4(u0, w0, 0x88);
    v[4 + k] = (u32x16)_mm512_shuffle_i32x4(u0, w0, 0xDD);
    v[8 + k] = (u32x16)_mm512_shuffle_i32x4(u1, w1, 0x88);
    v[12 + k] = (u32x16)_mm512_shuffle_i32x4(u1, w1, 0xDD);
  }
#else
  for (int i = 0; i < 16; ++i)
    for (int c = i + 1; c < 16; ++c) {
      const uint32_t x = v[i][c];
      v[i][c] = v[c][i];
      v[c][i] = x;
    }
#endif
}

// float32 -> bfloat16 bits, round to nearest, ties to even (Paddle's cast); a NaN -> a quiet NaN
// of its sign and top payload bits. What fd_bf16_linear rounds its input with (bf16_gemm.cc), and
// every kernel that writes rows for it.
inline uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// to_bf16 of 16 lanes of float32 bits, in each lane's high half (the low half zero).
inline u32x16 round_bf16_lanes(u32x16 b) {
  const u32x16 rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  const u32x16 nan = (b & 0xFFFF0000u) | 0x00400000u;
  return select((b & 0x7FFFFFFFu) > 0x7F800000u, nan, rounded);
}

// 32 consecutive floats (a: values 0-15, b: 16-31) as to_bf16 pairs: lane i holds value 2i in its
// low half and value 2i + 1 in its high half, the bfloat16 row [32] as 16 32-bit words.
inline u32x16 bf16_pairs32(f32x16 a, f32x16 b) {
  u32x16 even, odd;
  deinterleave(round_bf16_lanes(bitcast<u32x16>(a)), round_bf16_lanes(bitcast<u32x16>(b)), &even, &odd);
  return (even >> 16u) | (odd & 0xFFFF0000u);
}

// silu(g) * u for 16 lanes (SwiGLU): g * sigmoid(g) * u, the sigmoid from exp(-|g|) (no overflow
// for any g): fd_silu_mul's formula, and fd_bf16_linear_silu's epilogue, which must give its bits.
inline f32x16 silu_mul16(f32x16 g, f32x16 u) {
  const f32x16 neg_abs = select(g < 0.f, g, -g);
  const f32x16 e = exp16(neg_abs);
  const f32x16 sig = select(g < 0.f, e, f32x16{} + 1.f) / (e + 1.f);
  return g * sig * u;
}

// sum of a[i] * b[i] over d floats: 16-lane partial sums, then the tail in order.
inline float dot(const float* a, const float* b, int64_t d) {
  int64_t i = 0;
  float s = 0.f;
  if (d >= 16) {
    f32x16 acc{};
    for (; i + 16 <= d; i += 16) acc += load16(a + i) * load16(b + i);
    s = hsum(acc);
  }
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

// y += w * x over d floats.
inline void axpy(float w, const float* x, float* y, int64_t d) {
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) store16(y + i, load16(y + i) + w * load16(x + i));
  for (; i < d; ++i) y[i] += w * x[i];
}

}  // namespace fd_kernels
