// RMSNorm for the cpu device, alone and fused with the residual add before it.
//
//   fd_rms_norm(x [T, H], weight [H], eps) -> x / sqrt(mean(x^2) + eps) * weight
//   fd_add_rms_norm(x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)
//   fd_rms_norm_bf16, fd_add_rms_norm_bf16: the same, the normed rows rounded to bfloat16 (the
//     input of a bfloat16 linear layer, which reads them as they are)
//
// A decode step calls these 61 times on a few rows of 576 floats: a microsecond of work each.
// Paddle's fused_rms_norm spreads every call over its OpenMP team, whose barrier cost 20-60 us
// per call here and far more when the other core was busy. These run small inputs on the
// calling thread and hand rows of large ones (prefill) to the shared pool. Sums in float32, in
// 16-lane vectors.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "paddle/extension.h"
#include "graph.h"
#include "thread_pool.h"
#include "vector_math.h"

namespace {

using fd_kernels::f32x16;
using fd_kernels::load16;

struct NormJob {
  const float* x;
  const float* residual;  // nullptr: no add
  const float* weight;
  float* out;
  float* sum;  // x + residual, when residual != nullptr
  uint16_t* out16;  // not nullptr: the normed rows rounded to bfloat16 go here instead of out
  int64_t rows, hidden, rows_per_chunk;
  float eps;
};

// sum of x[i]^2 in four 16-lane accumulators: a scalar float sum is one 4-cycle dependency chain
// per element (the compiler may not reorder it), ~0.8 us per 576-float row, which made the norms
// of a 64-row decode step 5% of it.
float sum_of_squares(const float* x, int64_t n) {
  f32x16 a0{}, a1{}, a2{}, a3{};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const f32x16 v0 = load16(x + i), v1 = load16(x + i + 16), v2 = load16(x + i + 32), v3 = load16(x + i + 48);
    a0 += v0 * v0;
    a1 += v1 * v1;
    a2 += v2 * v2;
    a3 += v3 * v3;
  }
  for (; i + 16 <= n; i += 16) {
    const f32x16 v = load16(x + i);
    a0 += v * v;
  }
  float total = fd_kernels::hsum((a0 + a1) + (a2 + a3));
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

void norm_rows(void* ctx, int64_t chunk) {
  const NormJob& j = *static_cast<const NormJob*>(ctx);
  const int64_t begin = chunk * j.rows_per_chunk, end = std::min(j.rows, begin + j.rows_per_chunk);
  const int64_t H = j.hidden;
  for (int64_t r = begin; r < end; ++r) {
    const float* x = j.x + r * H;
    const float* src = x;
    if (j.residual != nullptr) {
      const float* res = j.residual + r * H;
      float* s = j.sum + r * H;
      for (int64_t i = 0; i < H; ++i) s[i] = x[i] + res[i];
      src = s;
    }
    const float squares = sum_of_squares(src, H);
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(H) + j.eps);
    if (j.out16 != nullptr) {  // the same values, rounded as fd_bf16_linear rounds its input
      uint16_t* o = j.out16 + r * H;
      int64_t i = 0;
      for (; i + 32 <= H; i += 32)
        fd_kernels::store(reinterpret_cast<uint32_t*>(o + i),
                          fd_kernels::bf16_pairs32(load16(src + i) * inv * load16(j.weight + i),
                                                   load16(src + i + 16) * inv * load16(j.weight + i + 16)));
      for (; i < H; ++i) o[i] = fd_kernels::to_bf16(src[i] * inv * j.weight[i]);
      continue;
    }
    float* o = j.out + r * H;
    for (int64_t i = 0; i < H; ++i) o[i] = src[i] * inv * j.weight[i];
  }
}

void check(const paddle::Tensor& x, const paddle::Tensor& weight) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && weight.dtype() == paddle::DataType::FLOAT32,
           "rms_norm takes float32");
  PD_CHECK(!x.shape().empty() && weight.numel() == x.shape().back(), "weight must have the hidden size ",
           x.shape().empty() ? 0 : x.shape().back(), ", has ", weight.numel());
}

void run(NormJob* job) {
  // Rows per chunk: a few thousand floats of work per claim; small inputs stay on this thread.
  job->rows_per_chunk = std::max<int64_t>(1, 16384 / std::max<int64_t>(job->hidden, 1));
  const int64_t chunks = (job->rows + job->rows_per_chunk - 1) / job->rows_per_chunk;
  fd_kernels::Pool::instance().run(chunks, norm_rows, job);
}

// The normed rows: float32, or bfloat16 (`bf16`: the rows a bfloat16 linear reads, rounded here once).
paddle::Tensor normed(const paddle::Tensor& x, bool bf16) {
  return fd_graph::empty(x.shape(), bf16 ? paddle::DataType::BFLOAT16 : paddle::DataType::FLOAT32);
}

std::vector<paddle::Tensor> rms_norm(const char* name, const paddle::Tensor& x_in, const paddle::Tensor& weight,
                                     float eps, bool bf16) {
  check(x_in, weight);
  auto out = normed(x_in, bf16);
  fd_graph::run(name, {&x_in, &weight}, {&out}, [x_in, weight, out, eps, bf16]() mutable {
    const paddle::Tensor x = x_in.contiguous();
    const int64_t H = x.shape().back();
    NormJob job{x.data<float>(), nullptr, weight.data<float>(), bf16 ? nullptr : out.data<float>(), nullptr,
                bf16 ? static_cast<uint16_t*>(out.data()) : nullptr, H ? x.numel() / H : 0, H, 1, eps};
    run(&job);
  });
  return {out};
}

std::vector<paddle::Tensor> add_rms_norm(const char* name, const paddle::Tensor& x_in, const paddle::Tensor& residual_in,
                                         const paddle::Tensor& weight, float eps, bool bf16) {
  check(x_in, weight);
  PD_CHECK(residual_in.shape() == x_in.shape() && residual_in.dtype() == paddle::DataType::FLOAT32,
           "residual must be float32 shaped like x");
  auto out = normed(x_in, bf16);
  auto sum = fd_graph::empty(x_in.shape(), paddle::DataType::FLOAT32);
  fd_graph::run(name, {&x_in, &residual_in, &weight}, {&out, &sum},
                [x_in, residual_in, weight, out, sum, eps, bf16]() mutable {
                  const paddle::Tensor x = x_in.contiguous();
                  const paddle::Tensor residual = residual_in.contiguous();
                  const int64_t H = x.shape().back();
                  NormJob job{x.data<float>(), residual.data<float>(), weight.data<float>(),
                              bf16 ? nullptr : out.data<float>(), sum.data<float>(),
                              bf16 ? static_cast<uint16_t*>(out.data()) : nullptr, H ? x.numel() / H : 0, H, 1, eps};
                  run(&job);
                });
  return {out, sum};
}

}  // namespace

std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x, const paddle::Tensor& weight, float eps) {
  return rms_norm("fd_rms_norm", x, weight, eps, false);
}

std::vector<paddle::Tensor> AddRmsNorm(const paddle::Tensor& x, const paddle::Tensor& residual,
                                       const paddle::Tensor& weight, float eps) {
  return add_rms_norm("fd_add_rms_norm", x, residual, weight, eps, false);
}

// The same norms with the normed rows rounded to bfloat16 (to_bf16, what fd_bf16_linear does to
// its float32 input): for a bfloat16 linear after the norm, which reads them as they are. A
// 2,048-row prompt step otherwise wrote 4.7 MB of float32 per norm that the linear read and
// rounded again.
std::vector<paddle::Tensor> RmsNormBf16(const paddle::Tensor& x, const paddle::Tensor& weight, float eps) {
  return rms_norm("fd_rms_norm_bf16", x, weight, eps, true);
}

std::vector<paddle::Tensor> AddRmsNormBf16(const paddle::Tensor& x, const paddle::Tensor& residual,
                                           const paddle::Tensor& weight, float eps) {
  return add_rms_norm("fd_add_rms_norm_bf16", x, residual, weight, eps, true);
}

std::vector<std::vector<int64_t>> RmsNormShape(const std::vector<int64_t>& x, const std::vector<int64_t>&, float) {
  return {x};
}

std::vector<std::vector<int64_t>> AddRmsNormShape(const std::vector<int64_t>& x, const std::vector<int64_t>&,
                                                  const std::vector<int64_t>&, float) {
  return {x, x};
}

std::vector<paddle::DataType> RmsNormDtype(const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

std::vector<paddle::DataType> AddRmsNormDtype(const paddle::DataType&, const paddle::DataType&,
                                              const paddle::DataType&) {
  return {paddle::DataType::FLOAT32, paddle::DataType::FLOAT32};
}

PD_BUILD_OP(fd_rms_norm)
    .Inputs({"X", "Weight"})
    .Outputs({"Out"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(RmsNorm))
    .SetInferShapeFn(PD_INFER_SHAPE(RmsNormShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RmsNormDtype));

PD_BUILD_OP(fd_add_rms_norm)
    .Inputs({"X", "Residual", "Weight"})
    .Outputs({"Out", "Sum"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(AddRmsNorm))
    .SetInferShapeFn(PD_INFER_SHAPE(AddRmsNormShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(AddRmsNormDtype));

std::vector<paddle::DataType> RmsNormBf16Dtype(const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::BFLOAT16};
}

std::vector<paddle::DataType> AddRmsNormBf16Dtype(const paddle::DataType&, const paddle::DataType&,
                                                  const paddle::DataType&) {
  return {paddle::DataType::BFLOAT16, paddle::DataType::FLOAT32};
}

PD_BUILD_OP(fd_rms_norm_bf16)
    .Inputs({"X", "Weight"})
    .Outputs({"Out"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(RmsNormBf16))
    .SetInferShapeFn(PD_INFER_SHAPE(RmsNormShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RmsNormBf16Dtype));

PD_BUILD_OP(fd_add_rms_norm_bf16)
    .Inputs({"X", "Residual", "Weight"})
    .Outputs({"Out", "Sum"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(AddRmsNormBf16))
    .SetInferShapeFn(PD_INFER_SHAPE(AddRmsNormShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(AddRmsNormBf16Dtype));
