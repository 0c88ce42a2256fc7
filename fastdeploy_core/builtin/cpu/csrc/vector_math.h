// 16-float vectors (GCC vector extensions: AVX-512 registers with -march=native, pairs of AVX2
// registers elsewhere) and the vector math the cpu kernels share.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace fd_kernels {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

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
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
#endif
}

// exp(x) for x <= 0 (softmax after subtracting the maximum), 16 lanes: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (relative error < 2e-7, as expf), 2^n built in
// the exponent bits. Inputs below -87 give 0. The scalar std::exp per score was most of a
// long prompt's attention time.
inline f32x16 exp16(f32x16 x_in) {
  const f32x16 lo = f32x16{} - 87.f;
  const f32x16 x = x_in < lo ? lo : x_in;
  const f32x16 n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f + (x < 0 ? -0.5f : 0.5f), i32x16), f32x16);
  const f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f32x16 p = f32x16{} + 1.3888889e-3f;
  p = p * r + 8.3333333e-3f;
  p = p * r + 4.1666667e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  const f32x16 e = p * (f32x16)bits;
  return x_in < lo ? f32x16{} : e;
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
