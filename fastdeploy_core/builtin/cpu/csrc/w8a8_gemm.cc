// W8A8 linear layers for the cpu device (--quantization w8a8): int8 weights with one scale per
// output channel times int8 activations with one dynamic scale per row, multiplied as integers.
//
//   xq[m, k] = round(clamp(x[m, k] / xs[m], -127, 127)), xs[m] = max_k |x[m, k]| / 127 (1 for a
//              zero row); round to nearest, ties to even (paddle.round), the division float32;
//   y[m, n]  = (float(sum_k xq[m, k] q[k, n]) * ws[n]) * xs[m], the sum exact in int32.
//
// The integer sum is exact, so the result is one rounding of it to float32 and two products:
// tests compare it bit for bit with that formula. The float32 reference of the quantizer
// (weight_only.int8_linear_reference with act_int8) sums the same products in float32, so the two
// differ by that summation's rounding only.
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
// Threads claim (panel of 64 rows, one or two column tiles) items and each tile runs the panel's
// rows in register blocks (row_panels.h, as fd_bf16_linear's do).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "graph.h"
#include "int8_dot.h"
#include "paddle/extension.h"
#include "row_panels.h"

namespace {

constexpr int64_t kCols = 32;                 // output columns per tile
constexpr int64_t kQuad = 4;                  // k per 32-bit lane
constexpr int64_t kQuadBytes = kCols * kQuad;  // one quad of k of one tile: 128 bytes
constexpr int64_t kPrefetchBytes = 2048;      // how far ahead a few-row tile asks for weights
constexpr float kMaxCode = 127.f;            // codes in [-127, 127]

// The rows of x as int8 codes, their scales and what the integer sums carry beyond sum q xq
// (128 * the sum of the row's codes where the weights are flipped, see above).
struct Rows {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> scale;  // [M]
  std::vector<int32_t> bias; // [M]
};

#if defined(FD_INT8_DOT)
using namespace fd_int8_dot;
constexpr int32_t kFlipBias = kDotU8Centred ? 0 : 128;
#else
constexpr int32_t kFlipBias = 0;
#endif

void quantize_rows(const float* x, int64_t M, int64_t K, Rows* out) {
  out->q.resize(static_cast<size_t>(M * K));
  out->scale.resize(M);
  out->bias.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    int8_t* qr = out->q.data() + m * K;
    float amax = 0.f;
    int64_t k = 0;
#if defined(FD_INT8_DOT)
    F32 vmax = zero_f();
    for (; k + 16 <= K; k += 16) vmax = max_f(vmax, abs_f(load_f(xr + k)));
    amax = reduce_max_f(vmax);
#endif
    for (; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    const float s = amax > 0.f ? amax / kMaxCode : 1.f;
    out->scale[m] = s;
    int32_t sum = 0;
    k = 0;
#if defined(FD_INT8_DOT)
    const F32 vs = set1_f(s), hi = set1_f(kMaxCode), lo = set1_f(-kMaxCode);
    I32 vsum = zero_i();
    for (; k + 16 <= K; k += 16) {
      // Clamped first (|v| may pass 127 by a rounding of the scale), then rounded to nearest
      // even by the conversion, as paddle.round and std::nearbyint.
      const I32 qi = round_i(min_f(hi, max_f(lo, div_f(load_f(xr + k), vs))));
      vsum = add_i(vsum, qi);
      store_bytes(qr + k, qi);
    }
    sum = reduce_add_i(vsum);
#endif
    for (; k < K; ++k) {
      const int q = static_cast<int>(std::nearbyint(std::min(kMaxCode, std::max(-kMaxCode, xr[k] / s))));
      qr[k] = static_cast<int8_t>(q);
      sum += q;
    }
    out->bias[m] = kFlipBias * sum;
  }
}

struct Problem {
  const int8_t* xq;     // [M, K]
  const int32_t* bias;  // [M]
  const float* xs;      // [M]
  const int8_t* w;      // [N / 32, K / 4, 32, 4]
  const float* ws;      // [N]
  float* y;             // [M, N]
  int64_t M, K, N;
};

#if defined(FD_INT8_DOT)
// Rows per register block: 8 rows x 2 vectors of int32 sums in zmm registers (16 of 32), or 2
// rows of AVX2 register pairs (8 of 16 ymm, the rest for the weights and vpmaddubsw's operands).
constexpr int kBlock = FD_INT8_DOT == 512 ? 8 : 2;

template <int ROWS>
void tile(const Problem& p, int64_t m, int64_t t) {
  const int8_t* wt = p.w + t * (p.K / kQuad) * kQuadBytes;
  const I32 flip = set1_i(static_cast<int32_t>(0x80808080u));
  I32 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = zero_i();
  const int8_t* xr = p.xq + m * p.K;
  for (int64_t c = 0; c < p.K / kQuad; ++c) {
    const int8_t* src = wt + c * kQuadBytes;
    if (ROWS <= 2) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes), _MM_HINT_T0);
    if (ROWS <= 2) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes + 64), _MM_HINT_T0);
    const I32 u0 = xor_i(load_i(src), flip), u1 = xor_i(load_i(src + 64), flip);
    for (int r = 0; r < ROWS; ++r) {
      int32_t four;
      std::memcpy(&four, xr + r * p.K + c * kQuad, 4);
      const I32 xv = set1_i(four);
      acc[r][0] = dot_u8(acc[r][0], u0, xv);
      acc[r][1] = dot_u8(acc[r][1], u1, xv);
    }
  }
  const float* ws = p.ws + t * kCols;
  const F32 ws0 = load_f(ws), ws1 = load_f(ws + 16);
  for (int r = 0; r < ROWS; ++r) {
    const I32 b = set1_i(p.bias[m + r]);
    const F32 xs = set1_f(p.xs[m + r]);
    float* yr = p.y + (m + r) * p.N + t * kCols;
    store_f(yr, mul_f(mul_f(to_f(sub_i(acc[r][0], b)), ws0), xs));
    store_f(yr + 16, mul_f(mul_f(to_f(sub_i(acc[r][1], b)), ws1), xs));
  }
}

void gemm(const Problem& p) {
  fd_kernels::run_row_panels(p.M, p.N / kCols, [&p](int64_t t, int64_t m_begin, int64_t m_end) {
    fd_kernels::row_blocks<kBlock>(m_begin, m_end, [&](auto rows, int64_t m) { tile<decltype(rows)::value>(p, m, t); });
  });
}
#else
// The same integers without integer dot products.
void gemm(const Problem& p) {
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = 0; n < p.N; ++n) {
      const int8_t* wt = p.w + (n / kCols) * (p.K / kQuad) * kQuadBytes + (n % kCols) * kQuad;
      int32_t sum = 0;
      for (int64_t k = 0; k < p.K; ++k) sum += p.xq[m * p.K + k] * wt[(k / kQuad) * kQuadBytes + k % kQuad];
      p.y[m * p.N + n] = (static_cast<float>(sum) * p.ws[n]) * p.xs[m];
    }
}
#endif

std::vector<int64_t> out_shape(const std::vector<int64_t>& x_shape, int64_t n) {
  std::vector<int64_t> shape(x_shape.begin(), x_shape.end() - 1);
  shape.push_back(n);
  return shape;
}

}  // namespace

std::vector<paddle::Tensor> W8a8Linear(const paddle::Tensor& x_in, const paddle::Tensor& weight,
                                       const paddle::Tensor& scale) {
  PD_CHECK(x_in.dtype() == paddle::DataType::FLOAT32, "x must be float32");
  PD_CHECK(weight.dtype() == paddle::DataType::INT8, "weight must be int8");
  const auto& ws = weight.shape();
  PD_CHECK(ws.size() == 4 && ws[2] == kCols && ws[3] == kQuad, "weight must be packed [N / 32, K / 4, 32, 4]");
  const int64_t K = ws[1] * kQuad, N = ws[0] * kCols;
  PD_CHECK(x_in.shape().back() == K, "x's last axis (", x_in.shape().back(), ") must equal the weight's K (", K, ")");
  PD_CHECK(scale.dtype() == paddle::DataType::FLOAT32 && scale.numel() == N,
           "scale must be float32 with one value per output channel (", N, ")");
  auto out = fd_graph::empty(out_shape(x_in.shape(), N), paddle::DataType::FLOAT32);
  fd_graph::run("fd_w8a8_linear", {&x_in, &weight, &scale}, {&out}, [=]() mutable {
    const paddle::Tensor x = x_in.contiguous();
    const int64_t M = K > 0 ? x.numel() / K : 0;
    Rows rows;
    quantize_rows(x.data<float>(), M, K, &rows);
    const Problem p{rows.q.data(), rows.bias.data(), rows.scale.data(), static_cast<const int8_t*>(weight.data()),
                    scale.data<float>(), out.data<float>(), M, K, N};
    if (M > 0) gemm(p);
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
    .SetKernelFn(PD_KERNEL(W8a8Linear))
    .SetInferShapeFn(PD_INFER_SHAPE(W8a8Shape))
    .SetInferDtypeFn(PD_INFER_DTYPE(W8a8Dtype));
