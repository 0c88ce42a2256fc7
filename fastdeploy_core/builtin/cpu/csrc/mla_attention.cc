// Multi-head latent attention (DeepSeek-V2/V3) in its absorbed form, over the paged latent cache.
//
// fd_mla_absorbed_attention: write each new token's latent row [c, k_pe] (L + dr floats) into
//   latent_cache [num_blocks, block_size, 1, L + dr] at its slot, then for every new token t
//   (position seq_lens[b] - q_len + i of its sequence b) and head i attend causally over the
//   latent rows 0 .. position without expanding a key or a value:
//     q_lat = w_k[i] q_nope          (w_k[i] = w_kv[i, :, :dn], an [L, dn] matrix: L numbers)
//     score_s = scale * (q_lat . c_s + q_pe . k_pe_s)   (one dot over the cached row's L + dr)
//     o_lat = sum_s softmax(score)_s c_s                 (L numbers)
//     out[t, i * dv : (i + 1) * dv] = o_lat w_v[i]       (w_v[i] = w_kv[i, :, dn:], [L, dv])
//   which equals attention with keys [c_s w_k[i], k_pe_s] and values c_s w_v[i] (the expanded
//   form) up to rounding. A work item is one (token, head): for decode steps, (sequence, head).
//   Each item keeps its scores (one float per visible key) in a per-thread buffer, takes the
//   maximum, exponentiates, and sums the latent rows weighted by the probabilities; softmax in
//   float32 with the maximum subtracted. Any mix of decode and prefill rows is computed (a
//   prefill row is just a token with more keys), but the ops table sends only the absorbed form
//   here: for prompt chunks the expanded form does less work per query token.
//
// The cache is written in place (the engine's long-lived buffer, as fd_rope_write_kv's). The op
// goes through fd_graph::run, so a recording of a decode step keeps it like any other op of
// this library; its sequence geometry is read from the tensors inside the closure, at replay.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paddle/extension.h"
#include "graph.h"
#include "line_buffer.h"
#include "thread_pool.h"
#include "vector_math.h"

namespace {

using fd_kernels::axpy;
using fd_kernels::dot;
using fd_kernels::exp16;
using fd_kernels::f32x16;
using fd_kernels::hsum;
using fd_kernels::load16;
using fd_kernels::store16;

struct MlaJob {
  const float* q;        // [T, h, dn + dr]
  const float* cache;    // [NB, bs, 1, L + dr]
  const float* w_kv;     // [h, L, dn + dv]
  const int64_t* token_pos;  // [T]
  const int64_t* token_seq;  // [T]
  const int64_t* tables;     // [B, max_blocks]
  int64_t max_blocks, block_size, heads, rank, rope, nope, v_dim;
  float scale;
  float* out;  // [T, h * dv]
};

void attend_item(void* ctx, int64_t index) {
  const MlaJob& j = *static_cast<const MlaJob*>(ctx);
  const int64_t t = index / j.heads, head = index % j.heads;
  const int64_t width = j.rank + j.rope, qk = j.nope + j.rope, wcols = j.nope + j.v_dim;
  const int64_t keys = j.token_pos[t] + 1;
  const int64_t padded = (keys + 15) / 16 * 16;
  thread_local fd_kernels::LineBuffer<float> qf, scores, o_lat;  // read as vectors (line_buffer.h)
  if (static_cast<int64_t>(qf.size()) < width) qf.resize(width);
  if (static_cast<int64_t>(o_lat.size()) < j.rank) o_lat.resize(j.rank);
  if (static_cast<int64_t>(scores.size()) < padded) scores.resize(padded);

  // The absorbed query: scale * [w_k q_nope, q_pe].
  const float* qh = j.q + (t * j.heads + head) * qk;
  const float* w = j.w_kv + head * j.rank * wcols;
  for (int64_t l = 0; l < j.rank; ++l) qf[l] = j.scale * dot(w + l * wcols, qh, j.nope);
  for (int64_t r = 0; r < j.rope; ++r) qf[j.rank + r] = j.scale * qh[j.nope + r];

  // Scores over the visible latent rows, block by block through the sequence's table.
  const int64_t* table = j.tables + j.token_seq[t] * j.max_blocks;
  float* s = scores.data();
  float mx = -INFINITY;
  for (int64_t p0 = 0; p0 < keys; p0 += j.block_size) {
    const float* block = j.cache + table[p0 / j.block_size] * j.block_size * width;
    const int64_t n = std::min(j.block_size, keys - p0);
    for (int64_t k = 0; k < n; ++k) {
      const float v = dot(qf.data(), block + k * width, width);
      s[p0 + k] = v;
      mx = std::max(mx, v);
    }
  }
  for (int64_t p = keys; p < padded; ++p) s[p] = -INFINITY;  // exp16 gives 0 below -87
  f32x16 sum{};
  const f32x16 m = f32x16{} + mx;
  for (int64_t p = 0; p < padded; p += 16) {
    const f32x16 e = exp16(load16(s + p) - m);
    store16(s + p, e);
    sum += e;
  }
  const float inv = 1.f / hsum(sum);

  // The probability-weighted sum of the latents, then the value up-projection.
  float* ol = o_lat.data();
  std::memset(ol, 0, j.rank * sizeof(float));
  for (int64_t p0 = 0; p0 < keys; p0 += j.block_size) {
    const float* block = j.cache + table[p0 / j.block_size] * j.block_size * width;
    const int64_t n = std::min(j.block_size, keys - p0);
    for (int64_t k = 0; k < n; ++k) axpy(s[p0 + k], block + k * width, ol, j.rank);
  }
  float* dst = j.out + (t * j.heads + head) * j.v_dim;
  std::memset(dst, 0, j.v_dim * sizeof(float));
  for (int64_t l = 0; l < j.rank; ++l) axpy(ol[l] * inv, w + l * wcols + j.nope, dst, j.v_dim);
}

struct Dims {
  int64_t T, heads, qk, width, rank, rope, nope, v_dim;
};

Dims check_dims(const paddle::Tensor& q, const paddle::Tensor& latent, const paddle::Tensor& cache,
                const paddle::Tensor& w_kv) {
  PD_CHECK(q.dtype() == paddle::DataType::FLOAT32 && q.shape().size() == 3, "q must be float32 [T, h, dn + dr]");
  PD_CHECK(latent.dtype() == paddle::DataType::FLOAT32 && latent.shape().size() == 2,
           "latent must be float32 [T, L + dr]");
  PD_CHECK(cache.dtype() == paddle::DataType::FLOAT32 && cache.shape().size() == 4 && cache.shape()[2] == 1,
           "latent_cache must be float32 [num_blocks, block_size, 1, L + dr]");
  PD_CHECK(w_kv.dtype() == paddle::DataType::FLOAT32 && w_kv.shape().size() == 3, "w_kv must be float32 [h, L, dn + dv]");
  Dims d{};
  d.T = q.shape()[0], d.heads = q.shape()[1], d.qk = q.shape()[2];
  d.width = latent.shape()[1], d.rank = w_kv.shape()[1];
  d.rope = d.width - d.rank, d.nope = d.qk - d.rope, d.v_dim = w_kv.shape()[2] - d.nope;
  PD_CHECK(latent.shape()[0] == d.T, "latent has ", latent.shape()[0], " rows for ", d.T, " query tokens");
  PD_CHECK(cache.shape()[3] == d.width, "latent_cache rows of ", cache.shape()[3], ", latent rows of ", d.width);
  PD_CHECK(w_kv.shape()[0] == d.heads, "w_kv has ", w_kv.shape()[0], " heads, q has ", d.heads);
  PD_CHECK(d.rope > 0 && d.nope > 0 && d.v_dim > 0, "inconsistent MLA sizes: q ", d.qk, ", latent ", d.width,
           ", w_kv [", w_kv.shape()[0], ", ", d.rank, ", ", w_kv.shape()[2], "]");
  return d;
}

void mla_absorbed_into(const paddle::Tensor& q_in, const paddle::Tensor& latent_in, const paddle::Tensor& cache,
                       const paddle::Tensor& slots, const paddle::Tensor& query_start, const paddle::Tensor& seq_lens,
                       const paddle::Tensor& block_tables, const paddle::Tensor& w_kv_in, float scale, float* out) {
  const Dims d = check_dims(q_in, latent_in, cache, w_kv_in);
  PD_CHECK(slots.dtype() == paddle::DataType::INT64 && slots.numel() == d.T, "slots must be int64 [T]");
  PD_CHECK(query_start.dtype() == paddle::DataType::INT64 && seq_lens.dtype() == paddle::DataType::INT64 &&
               block_tables.dtype() == paddle::DataType::INT64,
           "query_start, seq_lens and block_tables must be int64");
  const int64_t B = seq_lens.numel(), block_size = cache.shape()[1], num_blocks = cache.shape()[0];
  PD_CHECK(query_start.numel() == B + 1, "query_start must have one more entry than seq_lens");
  PD_CHECK(block_tables.shape().size() == 2 && block_tables.shape()[0] == B, "block_tables must be [B, max_blocks]");
  const int64_t max_blocks = block_tables.shape()[1];
  const int64_t* qs = query_start.data<int64_t>();
  const int64_t* lens = seq_lens.data<int64_t>();
  const int64_t* tables = block_tables.data<int64_t>();
  PD_CHECK(qs[0] == 0 && qs[B] == d.T, "query_start must run from 0 to the ", d.T, " query tokens");

  // The new rows into the cache first: a token attends to itself.
  const paddle::Tensor latent = latent_in.contiguous();
  const float* lp = latent.data<float>();
  const int64_t* slot = slots.data<int64_t>();
  float* cp = const_cast<float*>(cache.data<float>());  // in place: see the file comment
  for (int64_t t = 0; t < d.T; ++t) {
    PD_CHECK(slot[t] >= 0 && slot[t] < num_blocks * block_size, "slot ", slot[t], " outside the cache of ",
             num_blocks * block_size, " slots");
    std::memcpy(cp + slot[t] * d.width, lp + t * d.width, d.width * sizeof(float));
  }

  std::vector<int64_t> token_pos(d.T), token_seq(d.T);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qs[b + 1] - qs[b];
    PD_CHECK(q_len >= 0 && lens[b] >= q_len, "sequence ", b, ": ", q_len, " new tokens but seq_len ", lens[b]);
    const int64_t used = (lens[b] + block_size - 1) / block_size;
    PD_CHECK(used <= max_blocks, "sequence ", b, " needs more blocks than its table");
    for (int64_t p = 0; p < used; ++p)
      PD_CHECK(tables[b * max_blocks + p] >= 0 && tables[b * max_blocks + p] < num_blocks, "sequence ", b,
               " block table entry ", p, " = ", tables[b * max_blocks + p], " outside the cache's ", num_blocks,
               " blocks");
    for (int64_t i = 0; i < q_len; ++i) token_pos[qs[b] + i] = lens[b] - q_len + i, token_seq[qs[b] + i] = b;
  }
  if (d.T == 0) return;
  const paddle::Tensor q = q_in.contiguous();
  const paddle::Tensor w_kv = w_kv_in.contiguous();
  MlaJob job{q.data<float>(), cache.data<float>(), w_kv.data<float>(), token_pos.data(), token_seq.data(), tables,
             max_blocks,      block_size,          d.heads,            d.rank,           d.rope,           d.nope,
             d.v_dim,         scale,               out};
  fd_kernels::Pool::instance().run(d.T * d.heads, attend_item, &job);
}

}  // namespace

std::vector<paddle::Tensor> MlaAbsorbedAttention(const paddle::Tensor& q, const paddle::Tensor& latent,
                                                 const paddle::Tensor& latent_cache, const paddle::Tensor& slots,
                                                 const paddle::Tensor& query_start, const paddle::Tensor& seq_lens,
                                                 const paddle::Tensor& block_tables, const paddle::Tensor& w_kv,
                                                 float scale) {
  const Dims d = check_dims(q, latent, latent_cache, w_kv);
  auto out = fd_graph::empty({d.T, d.heads * d.v_dim}, paddle::DataType::FLOAT32);
  fd_graph::run("fd_mla_absorbed_attention",
                {&q, &latent, &latent_cache, &slots, &query_start, &seq_lens, &block_tables, &w_kv}, {&out},
                [=]() mutable {
                  mla_absorbed_into(q, latent, latent_cache, slots, query_start, seq_lens, block_tables, w_kv, scale,
                                    out.data<float>());
                });
  return {out};
}

std::vector<std::vector<int64_t>> MlaAbsorbedAttentionShape(const std::vector<int64_t>& q,
                                                            const std::vector<int64_t>& latent,
                                                            const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                            const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                            const std::vector<int64_t>&,
                                                            const std::vector<int64_t>& w_kv, float) {
  const int64_t nope = q[2] - (latent[1] - w_kv[1]);
  return {{q[0], q[1] * (w_kv[2] - nope)}};
}

std::vector<paddle::DataType> MlaAbsorbedAttentionDtype(const paddle::DataType&, const paddle::DataType&,
                                                        const paddle::DataType&, const paddle::DataType&,
                                                        const paddle::DataType&, const paddle::DataType&,
                                                        const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(fd_mla_absorbed_attention)
    .Inputs({"Q", "Latent", "LatentCache", "Slots", "QueryStart", "SeqLens", "BlockTables", "WKV"})
    .Outputs({"Out"})
    .Attrs({"scale: float"})
    .SetKernelFn(PD_KERNEL(MlaAbsorbedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(MlaAbsorbedAttentionShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(MlaAbsorbedAttentionDtype));
