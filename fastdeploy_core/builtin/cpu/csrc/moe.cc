// fd_fused_moe: the routed experts of a mixture-of-experts layer, SwiGLU experts.
//
//   y[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j]
//
// x float32 [T, H]; w13 the experts' gate then up projections, w2 their down projections, each
// either plain ([E, H, 2I] and [E, I, H], Paddle's [in, out]) or packed by
// CpuOps.prepare_expert_weight into 32-column tiles per expert ([E, 2I / 32, H, 32] and
// [E, H / 32, I, 32]: each expert's weight in fd_f32_linear's packed layout); the rank says
// which. topk_weights float32 [T, k], topk_ids int64 [T, k].
//
// The (token, choice) rows are grouped by expert with a counting sort (stable: rows of an
// expert keep token order), so each expert used in the step multiplies all its rows at once
// with fd_f32_linear's tile loop (f32_tiles.h): one pass over an expert's weights per 8 rows
// instead of one per token, and the experts nobody chose are not read at all. Plain weights
// are first copied, for the used experts only, into the packed layout (columns padded to a
// multiple of 32 with zeros): that is the path of weights whose width is not a multiple of 32
// and of the quantized experts' reference path, which widens its experts to plain float32.
//
// Everything that depends on tensor data (the grouping, the per-expert row counts) runs inside
// the fd_graph::run closure, so a captured step regroups on every replay. Threads
// (thread_pool.h): jobs of (expert, 32-column tile) for both projections, rows for SwiGLU and
// for the weighted sum.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "f32_tiles.h"
#include "graph.h"
#include "line_buffer.h"
#include "paddle/extension.h"
#include "thread_pool.h"
#include "vector_math.h"

namespace {

using fd_kernels::kTileColumns;

// One projection's weights: for each expert, where its packed [Np / 32, K, 32] tiles start.
struct Projection {
  int64_t E = 0, K = 0, N = 0;
  int64_t Np = 0;  // N rounded up to whole tiles
  bool packed = false;
  const float* data = nullptr;
  std::vector<const float*> expert;  // packed tiles of each used expert
  std::vector<float> scratch;        // plain weights of the used experts, repacked
};

void describe(const paddle::Tensor& w, const char* name, Projection* p) {
  PD_CHECK(w.dtype() == paddle::DataType::FLOAT32, name, " must be float32");
  const auto& s = w.shape();
  if (s.size() == 4) {
    PD_CHECK(s[3] == kTileColumns, name, ": packed expert weights are [E, N / 32, K, 32], got last axis ", s[3]);
    p->E = s[0];
    p->K = s[2];
    p->N = s[1] * kTileColumns;
    p->packed = true;
  } else {
    PD_CHECK(s.size() == 3, name, " must be [E, K, N] or packed [E, N / 32, K, 32]");
    p->E = s[0];
    p->K = s[1];
    p->N = s[2];
    p->packed = false;
  }
  p->Np = (p->N + kTileColumns - 1) / kTileColumns * kTileColumns;
}

// Expert e of a plain [E, K, N] weight into packed tiles [Np / 32, K, 32] (padding columns 0).
void pack_expert(const Projection& p, int64_t e, float* out) {
  const float* w = p.data + e * p.K * p.N;
  for (int64_t t = 0; t < p.Np / kTileColumns; ++t) {
    const int64_t n0 = t * kTileColumns, width = std::min(kTileColumns, p.N - n0);
    float* tile = out + t * p.K * kTileColumns;
    for (int64_t k = 0; k < p.K; ++k) {
      std::memcpy(tile + k * kTileColumns, w + k * p.N + n0, width * sizeof(float));
      if (width < kTileColumns) std::memset(tile + k * kTileColumns + width, 0, (kTileColumns - width) * sizeof(float));
    }
  }
}

struct Step {
  int64_t T, k, H, I;
  const float* x;
  const float* weights;
  const int64_t* ids;
  float* y;
  Projection* w13;
  Projection* w2;
  std::vector<int64_t> used;         // experts with rows, ascending
  std::vector<int64_t> begin;        // first grouped row of each used expert (+ end)
  std::vector<int64_t> row_of;       // (t * k + j) -> grouped row
  std::vector<float> rows, gate_up, hidden, down;  // [R, H], [R, 2I], [R, I], [R, H]
};

// Rows [begin, end) of `in` ([R, K]) times the packed tiles of one expert, tile t, into
// columns [32 t, 32 t + 32) of `out` ([R, N], columns past N dropped).
void expert_tile(const float* in, int64_t begin, int64_t end, const Projection& p, const float* w, int64_t t,
                 float* out) {
  thread_local fd_kernels::LineBuffer<float> buf;  // rows of 32 columns, stored as vectors
  const int64_t rows = end - begin;
  buf.resize(rows * kTileColumns);
  fd_kernels::f32_linear_tile(in + begin * p.K, rows, p.K, w, t, rows <= 2, buf.data());
  const int64_t n0 = t * kTileColumns, width = std::min(kTileColumns, p.N - n0);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out + (begin + r) * p.N + n0, buf.data() + r * kTileColumns, width * sizeof(float));
}

struct ProjectionJob {
  Step* s;
  const Projection* p;
  const float* in;
  float* out;
  int64_t tiles;
};

void projection_chunk(void* ctx, int64_t c) {
  const ProjectionJob& j = *static_cast<const ProjectionJob*>(ctx);
  const int64_t u = c / j.tiles, t = c % j.tiles;
  expert_tile(j.in, j.s->begin[u], j.s->begin[u + 1], *j.p, j.p->expert[u], t, j.out);
}

void project(Step* s, const Projection& p, const float* in, float* out) {
  ProjectionJob job{s, &p, in, out, p.Np / kTileColumns};
  fd_kernels::Pool::instance().run(static_cast<int64_t>(s->used.size()) * job.tiles, projection_chunk, &job);
}

void pack_chunk(void* ctx, int64_t c) {
  Step& s = *static_cast<Step*>(ctx);
  const int64_t used = static_cast<int64_t>(s.used.size());
  Projection& p = c < used ? *s.w13 : *s.w2;
  const int64_t u = c % used;
  pack_expert(p, s.used[u], p.scratch.data() + u * p.Np * p.K);
}

// silu(gate) * up, sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below with e = exp(-|g|)
// (activation.cc's formula, so the exponent never overflows).
void swiglu_chunk(void* ctx, int64_t r) {
  Step& s = *static_cast<Step*>(ctx);
  const int64_t I = s.I;
  const float* gate = s.gate_up.data() + r * 2 * I;
  const float* up = gate + I;
  float* o = s.hidden.data() + r * I;
  int64_t i = 0;
  for (; i + 16 <= I; i += 16) {
    const fd_kernels::f32x16 g = fd_kernels::load16(gate + i);
    const fd_kernels::f32x16 e = fd_kernels::exp16(fd_kernels::select(g < 0.f, g, -g));
    const fd_kernels::f32x16 sig = fd_kernels::select(g < 0.f, e, fd_kernels::f32x16{} + 1.f) / (e + 1.f);
    fd_kernels::store16(o + i, g * sig * fd_kernels::load16(up + i));
  }
  for (; i < I; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// y[t] = sum_j weights[t, j] * down[row_of(t, j)], the k choices in order.
void combine_chunk(void* ctx, int64_t t) {
  Step& s = *static_cast<Step*>(ctx);
  float* out = s.y + t * s.H;
  std::fill(out, out + s.H, 0.f);
  for (int64_t j = 0; j < s.k; ++j) {
    const float w = s.weights[t * s.k + j];
    const float* d = s.down.data() + s.row_of[t * s.k + j] * s.H;
    for (int64_t h = 0; h < s.H; ++h) out[h] += w * d[h];
  }
}

void run_step(Step& s) {
  const int64_t E = s.w13->E, R = s.T * s.k;
  // Counting sort of the (token, choice) rows by expert.
  std::vector<int64_t> count(E, 0);
  for (int64_t i = 0; i < R; ++i) {
    const int64_t e = s.ids[i];
    PD_CHECK(e >= 0 && e < E, "fd_fused_moe: expert id ", e, " (token ", i / s.k, ") is outside [0, ", E, ")");
    ++count[e];
  }
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + count[e];
  s.used.clear();
  s.begin.clear();
  for (int64_t e = 0; e < E; ++e)
    if (count[e]) {
      s.used.push_back(e);
      s.begin.push_back(start[e]);
    }
  s.begin.push_back(R);
  s.row_of.resize(R);
  s.rows.resize(R * s.H);
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < R; ++i) {
    const int64_t row = next[s.ids[i]]++;
    s.row_of[i] = row;
    std::memcpy(s.rows.data() + row * s.H, s.x + (i / s.k) * s.H, s.H * sizeof(float));
  }
  // Each used expert's packed tiles: in place, or repacked from the plain layout.
  const int64_t used = static_cast<int64_t>(s.used.size());
  int64_t to_pack = 0;
  for (Projection* p : {s.w13, s.w2}) {
    p->expert.resize(used);
    if (p->packed) {
      for (int64_t u = 0; u < used; ++u) p->expert[u] = p->data + s.used[u] * p->N * p->K;
    } else {
      p->scratch.resize(used * p->Np * p->K);
      for (int64_t u = 0; u < used; ++u) p->expert[u] = p->scratch.data() + u * p->Np * p->K;
      ++to_pack;
    }
  }
  if (to_pack) {
    // Jobs [0, used) pack w13 experts, [used, 2 used) w2 experts; a packed one is skipped.
    struct PackJob {
      Step* s;
      int64_t used;
    } job{&s, used};
    fd_kernels::Pool::instance().run(
        2 * used,
        [](void* ctx, int64_t c) {
          const PackJob& j = *static_cast<const PackJob*>(ctx);
          if (!(c < j.used ? j.s->w13 : j.s->w2)->packed) pack_chunk(j.s, c);
        },
        &job);
  }
  s.gate_up.resize(R * 2 * s.I);
  s.hidden.resize(R * s.I);
  s.down.resize(R * s.H);
  project(&s, *s.w13, s.rows.data(), s.gate_up.data());
  fd_kernels::Pool::instance().run(R, swiglu_chunk, &s);
  project(&s, *s.w2, s.hidden.data(), s.down.data());
  fd_kernels::Pool::instance().run(s.T, combine_chunk, &s);
}

}  // namespace

std::vector<paddle::Tensor> FusedMoe(const paddle::Tensor& x_in, const paddle::Tensor& w13, const paddle::Tensor& w2,
                                     const paddle::Tensor& topk_weights_in, const paddle::Tensor& topk_ids_in) {
  PD_CHECK(x_in.dtype() == paddle::DataType::FLOAT32 && x_in.shape().size() == 2, "x must be float32 [T, H]");
  PD_CHECK(topk_weights_in.dtype() == paddle::DataType::FLOAT32 && topk_weights_in.shape().size() == 2,
           "topk_weights must be float32 [T, k]");
  PD_CHECK(topk_ids_in.dtype() == paddle::DataType::INT64 && topk_ids_in.shape() == topk_weights_in.shape(),
           "topk_ids must be int64 shaped like topk_weights");
  Projection a, b;
  describe(w13, "w13", &a);
  describe(w2, "w2", &b);
  const int64_t T = x_in.shape()[0], H = x_in.shape()[1], k = topk_ids_in.shape()[1];
  PD_CHECK(topk_ids_in.shape()[0] == T, "topk_ids has ", topk_ids_in.shape()[0], " rows for ", T, " tokens");
  PD_CHECK(a.K == H, "w13's input size (", a.K, ") must equal x's hidden size (", H, ")");
  PD_CHECK(a.N % 2 == 0, "w13's output (", a.N, ") must hold gate and up halves");
  const int64_t I = a.N / 2;
  PD_CHECK(b.E == a.E && b.K == I && b.N == H, "w2 must be [E, I, H] = [", a.E, ", ", I, ", ", H, "] (or packed)");
  auto out = fd_graph::empty({T, H}, paddle::DataType::FLOAT32);
  fd_graph::run("fd_fused_moe", {&x_in, &w13, &w2, &topk_weights_in, &topk_ids_in}, {&out},
                [=]() mutable {
                  const paddle::Tensor x = x_in.contiguous();
                  const paddle::Tensor weights = topk_weights_in.contiguous();
                  const paddle::Tensor ids = topk_ids_in.contiguous();
                  // Scratch kept per calling thread: a decode step reuses the last step's buffers.
                  thread_local Projection p13, p2;
                  thread_local Step s;
                  p13.E = a.E, p13.K = a.K, p13.N = a.N, p13.Np = a.Np, p13.packed = a.packed;
                  p2.E = b.E, p2.K = b.K, p2.N = b.N, p2.Np = b.Np, p2.packed = b.packed;
                  p13.data = w13.data<float>();
                  p2.data = w2.data<float>();
                  s.T = T, s.k = k, s.H = H, s.I = I;
                  s.x = x.data<float>();
                  s.weights = weights.data<float>();
                  s.ids = ids.data<int64_t>();
                  s.y = out.data<float>();
                  s.w13 = &p13;
                  s.w2 = &p2;
                  if (T > 0) run_step(s);
                });
  return {out};
}

std::vector<std::vector<int64_t>> FusedMoeShape(const std::vector<int64_t>& x, const std::vector<int64_t>&,
                                                const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                const std::vector<int64_t>&) {
  return {x};
}

std::vector<paddle::DataType> FusedMoeDtype(const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
                                            const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(fd_fused_moe)
    .Inputs({"X", "W13", "W2", "TopkWeights", "TopkIds"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(FusedMoe))
    .SetInferShapeFn(PD_INFER_SHAPE(FusedMoeShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(FusedMoeDtype));
