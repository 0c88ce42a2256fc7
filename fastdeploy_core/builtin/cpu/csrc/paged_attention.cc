// Attention ops of the cpu device over the paged KV cache, one op call per layer each.
//
// fd_rope_write_kv: from a fused QKV projection [T, (h + 2 kvh) * d], rotate the query and key
//   heads by their positions (HF rotate_half style, from the engine's cos/sin table
//   [max_positions, 2, d] whose second row is the signed sin [-sin, sin]: out = x * cos +
//   roll(x, d / 2) * sin), write the rotated keys and the values into the caches at the
//   tokens' slots, and return the rotated queries [T, h, d]. It replaces ~10 small Paddle ops
//   (split, gather, roll, multiply, add, two scatters) per layer.
//
// fd_rope_paged_attention: both in one call (what the cpu ops table runs per layer).
//
// fd_paged_attention: causal attention of every new token over its sequence's cached context,
//   for any mix of decode and prefill rows: token i of sequence b (query rows
//   [query_start[b], query_start[b + 1])) sits at position seq_lens[b] - q_len + i and sees the
//   keys at positions 0 .. that position (with sliding_window w > 0 only the last w of them,
//   itself included: keys p > position - w, as HF's Mistral), read block by block through block_tables. Grouped
//   query heads that share a KV head are computed together, so each key and value row is
//   loaded once per group. Softmax in float32 with the maximum subtracted. One work item is
//   (query token, KV head); the pool's threads claim items.
//
// The caches are [num_blocks, block_size, kvh, d] float32 and are written in place: they are
// the engine's long-lived KV buffers, not values of a graph (the ops run eagerly on the cpu).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paddle/extension.h"
#include "graph.h"
#include "thread_pool.h"
#include "vector_math.h"

namespace {

using fd_kernels::exp16;
using fd_kernels::f32x16;
using fd_kernels::hsum;
using fd_kernels::i32x16;
using fd_kernels::load16;
using fd_kernels::store16;
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

inline void rotate(const float* x, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

void check_cache(const paddle::Tensor& cache, const char* name, int64_t kvh, int64_t d) {
  PD_CHECK(cache.dtype() == paddle::DataType::FLOAT32 && cache.shape().size() == 4, name,
           " must be float32 [num_blocks, block_size, kvh, d]");
  PD_CHECK(cache.shape()[2] == kvh && cache.shape()[3] == d, name, " has ", cache.shape()[2], " heads of ",
           cache.shape()[3], ", expected ", kvh, " of ", d);
}

}  // namespace

namespace {

// fd_rope_write_kv's shape checks; returns the head size.
int64_t check_rope(const paddle::Tensor& qkv, const paddle::Tensor& positions, const paddle::Tensor& cos_sin,
                   const paddle::Tensor& k_cache, const paddle::Tensor& v_cache, const paddle::Tensor& slots,
                   int64_t num_heads, int64_t num_kv_heads) {
  PD_CHECK(qkv.dtype() == paddle::DataType::FLOAT32 && qkv.shape().size() == 2, "qkv must be float32 [T, (h + 2 kvh) * d]");
  PD_CHECK(num_heads > 0 && num_kv_heads > 0, "head counts must be positive");
  const int64_t T = qkv.shape()[0], width = qkv.shape()[1], heads = num_heads + 2 * num_kv_heads;
  PD_CHECK(width % heads == 0, "qkv width ", width, " is not a multiple of h + 2 kvh = ", heads);
  const int64_t d = width / heads;
  PD_CHECK(d % 2 == 0, "the head size must be even for rotary embeddings");
  PD_CHECK(cos_sin.dtype() == paddle::DataType::FLOAT32 && cos_sin.shape().size() == 3 && cos_sin.shape()[1] == 2 &&
               cos_sin.shape()[2] == d,
           "cos_sin must be float32 [max_positions, 2, d]");
  PD_CHECK(positions.dtype() == paddle::DataType::INT64 && positions.numel() == T, "positions must be int64 [T]");
  PD_CHECK(slots.dtype() == paddle::DataType::INT64 && slots.numel() == T, "slots must be int64 [T]");
  check_cache(k_cache, "k_cache", num_kv_heads, d);
  check_cache(v_cache, "v_cache", num_kv_heads, d);
  return d;
}

// Rotary embedding of Q into q_out ([T, h, d]) and of K into the cache, V copied to the cache.
void rope_write_kv_into(const paddle::Tensor& qkv, const paddle::Tensor& positions, const paddle::Tensor& cos_sin,
                        const paddle::Tensor& k_cache, const paddle::Tensor& v_cache, const paddle::Tensor& slots,
                        int64_t num_heads, int64_t num_kv_heads, int64_t d, float* qp) {
  const int64_t T = qkv.shape()[0], width = qkv.shape()[1];
  const int64_t num_slots = k_cache.shape()[0] * k_cache.shape()[1], max_pos = cos_sin.shape()[0];
  const paddle::Tensor x = qkv.contiguous();
  const float* xp = x.data<float>();
  const float* table = cos_sin.data<float>();
  const int64_t* pos = positions.data<int64_t>();
  const int64_t* slot = slots.data<int64_t>();
  float* kc = const_cast<float*>(k_cache.data<float>());  // in place: see the file comment
  float* vc = const_cast<float*>(v_cache.data<float>());
  for (int64_t t = 0; t < T; ++t) {
    PD_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the rotary table of ", max_pos);
    PD_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " outside the cache of ", num_slots, " slots");
    const float* row = xp + t * width;
    const float* cos = table + pos[t] * 2 * d;
    const float* sin = cos + d;
    for (int64_t h = 0; h < num_heads; ++h) rotate(row + h * d, cos, sin, qp + (t * num_heads + h) * d, d);
    float* k_dst = kc + slot[t] * num_kv_heads * d;
    float* v_dst = vc + slot[t] * num_kv_heads * d;
    for (int64_t g = 0; g < num_kv_heads; ++g) rotate(row + (num_heads + g) * d, cos, sin, k_dst + g * d, d);
    std::memcpy(v_dst, row + (num_heads + num_kv_heads) * d, num_kv_heads * d * sizeof(float));
  }
}

}  // namespace

std::vector<paddle::Tensor> RopeWriteKv(const paddle::Tensor& qkv, const paddle::Tensor& positions,
                                        const paddle::Tensor& cos_sin, const paddle::Tensor& k_cache,
                                        const paddle::Tensor& v_cache, const paddle::Tensor& slots, int64_t num_heads,
                                        int64_t num_kv_heads) {
  const int64_t d = check_rope(qkv, positions, cos_sin, k_cache, v_cache, slots, num_heads, num_kv_heads);
  auto q_out = fd_graph::empty({qkv.shape()[0], num_heads, d}, paddle::DataType::FLOAT32);
  fd_graph::run("fd_rope_write_kv", {&qkv, &positions, &cos_sin, &k_cache, &v_cache, &slots}, {&q_out},
                [=]() mutable {
                  rope_write_kv_into(qkv, positions, cos_sin, k_cache, v_cache, slots, num_heads, num_kv_heads, d,
                                     q_out.data<float>());
                });
  return {q_out};
}

namespace {

struct AttentionJob {
  const float* q;  // [T, h, d]
  const float* k;  // cache [NB, bs, kvh, d]
  const float* v;
  const int64_t* token_seq;  // [T]: sequence of each query token
  const int64_t* token_pos;  // [T]: its position (keys 0..pos are visible)
  const int64_t* tables;     // [B, MB]
  int64_t max_blocks, block_size, num_heads, num_kv_heads, d, window;
  int64_t heads_per_item;   // kv heads per work item: 1, or all of them (whole cache rows)
  int64_t tokens_per_item;  // consecutive query tokens per work item
  int64_t num_tokens;
  float scale;
  float* out;  // [T, h, d]
};

// Rows ahead of the one being read whose K and V lines are requested (prefetched). One item's
// keys are a short walk that the hardware prefetcher does not pick up before it ends: without
// asking for rows ahead, a 64-sequence decode step spent most of its attention waiting on DRAM.
// Requests go to L2 (prefetcht1): into L1 they evicted the rows the current head's passes
// re-read (0.57 -> 0.43 ms per layer, 64 decodes of 103 keys, cold caches, with Streamer).
constexpr int64_t kPrefetchRows = 8;

// Below this many (key, kv head) pairs a step's few query tokens run as one item per token on the
// calling thread: waking a worker costs more than the work.
constexpr int64_t kSplitKeys = 4096;

// At most this many consecutive query tokens per work item.
constexpr int64_t kTokensPerItem = 8;

inline void prefetch_row(const float* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(float)); off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

// The cache offsets (in floats, head 0) of key positions first .. first + n - 1, walking the
// sequence's block table one block at a time (no division per key).
void key_offsets(const int64_t* table, int64_t block_size, int64_t first, int64_t n, int64_t row_stride,
                 int64_t* off) {
  const int64_t last = first + n - 1;
  for (int64_t b = first / block_size; b * block_size <= last; ++b) {
    const int64_t lo = std::max(first, b * block_size), hi = std::min(last, b * block_size + block_size - 1);
    const int64_t base = table[b] * block_size - b * block_size;
    for (int64_t p = lo; p <= hi; ++p) off[p - first] = (base + p) * row_stride;
  }
}

// The 16 sums of 16 vectors: r[i] = sum of v[i]'s lanes (a transpose-and-add tree, ~3
// instructions per vector instead of a full horizontal reduction each).
inline f32x16 sum16(const f32x16* v) {
#if defined(__AVX512F__)
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = (__m512)v[2 * i], b = (__m512)v[2 * i + 1];
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // u[i]'s 128-bit lane L holds lane L's sums of v[4i .. 4i + 3]; add the four lanes.
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return (f32x16)_mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
#else
  f32x16 r{};
  for (int i = 0; i < 16; ++i) r[i] = hsum(v[i]);
  return r;
#endif
}

// What the first score pass of a token asks for (a token not streamed in): from the row starts k and v, `width`
// floats of every key row (the K rows kPrefetchRows ahead, the V rows the weighted sums will
// read). Later passes of the item find the rows in cache and pass k = nullptr.
struct Prefetch {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t width = 0;
};

// The K and V rows of the next query token of a work item, requested a few cache lines per key
// while the current token computes (its later passes read rows already in cache): the loads
// from DRAM then overlap with arithmetic instead of stalling the first pass of every token
// (with the L2 hint above: 64 decodes of 103 keys, cold caches, 0.57 -> 0.43 ms per layer; reading
// the rows alone takes 0.34 ms, computing on them in cache 0.25 ms).
struct Streamer {
  const float* k = nullptr;  // row starts (head 0) of the cache
  const float* v = nullptr;
  const int64_t* off = nullptr;  // the next token's key offsets
  int64_t rows = 0, row_lines = 0;
  int64_t row = 0, line = 0;  // the next line to request: line `line` of K row `row` (V rows follow K's)

  void start(const float* k_, const float* v_, const int64_t* off_, int64_t rows_, int64_t row_bytes) {
    k = k_, v = v_, off = off_, rows = rows_, row_lines = (row_bytes + 63) / 64, row = 0, line = 0;
  }

  inline void step(int lines) {
    for (int i = 0; i < lines && row < 2 * rows; ++i) {
      const float* base = row < rows ? k + off[row] : v + off[row - rows];
      _mm_prefetch(reinterpret_cast<const char*>(base) + line * 64, _MM_HINT_T1);
      if (++line == row_lines) line = 0, ++row;
    }
  }
};

// Scores s[i] = q . key_i (q already scaled) for n keys at k + off[i], head size 16 * D16:
// 16 keys at a time, each key's partial products in one vector, then one tree of sums.
template <int D16>
void scores_fixed(const float* q, const float* k, const int64_t* off, int64_t n, float* s, const Prefetch& pf,
                  Streamer& st) {
  f32x16 qv[D16];
  for (int c = 0; c < D16; ++c) qv[c] = load16(q + 16 * c);
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - i0);
    f32x16 part[16];
    for (int64_t j = 0; j < m; ++j) {
      if (pf.k != nullptr) {
        if (i0 + j + kPrefetchRows < n) prefetch_row(pf.k + off[i0 + j + kPrefetchRows], pf.width);
        prefetch_row(pf.v + off[i0 + j], pf.width);
      }
      st.step(2);
      const float* row = k + off[i0 + j];
      f32x16 acc = qv[0] * load16(row);
      for (int c = 1; c < D16; ++c) acc += qv[c] * load16(row + 16 * c);
      part[j] = acc;
    }
    for (int64_t j = m; j < 16; ++j) part[j] = f32x16{};
    store16(s + i0, sum16(part));
  }
}

// out = sum_i p[i] * value_i for n values at v + off[i], the output row held in registers.
template <int D16>
void weighted_sum_fixed(const float* p, const float* v, const int64_t* off, int64_t n, float* out, Streamer& st) {
  f32x16 acc[D16] = {};
  for (int64_t i = 0; i < n; ++i) {
    st.step(2);
    const float* row = v + off[i];
    const f32x16 w = f32x16{} + p[i];
    for (int c = 0; c < D16; ++c) acc[c] += w * load16(row + 16 * c);
  }
  for (int c = 0; c < D16; ++c) store16(out + 16 * c, acc[c]);
}

// Any head size: one dot product per key, values accumulated in the output row.
void scores_any(const float* q, const float* k, const int64_t* off, int64_t n, int64_t d, float* s,
                const Prefetch& pf, Streamer& st) {
  for (int64_t i = 0; i < n; ++i) {
    st.step(2);
    if (pf.k != nullptr) {
      if (i + kPrefetchRows < n) prefetch_row(pf.k + off[i + kPrefetchRows], pf.width);
      prefetch_row(pf.v + off[i], pf.width);
    }
    s[i] = dot(q, k + off[i], d);
  }
}

void weighted_sum_any(const float* p, const float* v, const int64_t* off, int64_t n, int64_t d, float* out,
                      Streamer& st) {
  std::memset(out, 0, d * sizeof(float));
  for (int64_t i = 0; i < n; ++i) {
    st.step(2);
    axpy(p[i], v + off[i], out, d);
  }
}

void scores(const float* q, const float* k, const int64_t* off, int64_t n, int64_t d, float* s, const Prefetch& pf,
            Streamer& st) {
  switch (d) {
    case 16: return scores_fixed<1>(q, k, off, n, s, pf, st);
    case 32: return scores_fixed<2>(q, k, off, n, s, pf, st);
    case 64: return scores_fixed<4>(q, k, off, n, s, pf, st);
    case 128: return scores_fixed<8>(q, k, off, n, s, pf, st);
    default: return scores_any(q, k, off, n, d, s, pf, st);
  }
}

void weighted_sum(const float* p, const float* v, const int64_t* off, int64_t n, int64_t d, float* out, Streamer& st) {
  switch (d) {
    case 16: return weighted_sum_fixed<1>(p, v, off, n, out, st);
    case 32: return weighted_sum_fixed<2>(p, v, off, n, out, st);
    case 64: return weighted_sum_fixed<4>(p, v, off, n, out, st);
    case 128: return weighted_sum_fixed<8>(p, v, off, n, out, st);
    default: return weighted_sum_any(p, v, off, n, d, out, st);
  }
}

// Softmax of n scores in place; s is padded with -inf to a whole number of vectors.
void softmax(float* s, int64_t padded) {
  f32x16 mv = load16(s);
  for (int64_t p = 16; p < padded; p += 16) {
    const f32x16 v = load16(s + p);
    mv = v > mv ? v : mv;
  }
  float m = mv[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, mv[i]);
  f32x16 sumv{};
  for (int64_t p = 0; p < padded; p += 16) {
    const f32x16 e = exp16(load16(s + p) - m);  // the -inf padding gives 0
    store16(s + p, e);
    sumv += e;
  }
  const float inv = 1.f / hsum(sumv);
  for (int64_t p = 0; p < padded; p += 16) store16(s + p, load16(s + p) * inv);
}

// The keys query token t sees: positions first .. first + n - 1.
inline void visible_keys(const AttentionJob& j, int64_t t, int64_t* first, int64_t* n) {
  const int64_t last = j.token_pos[t];
  *first = j.window > 0 ? std::max<int64_t>(0, last - j.window + 1) : 0;
  *n = last + 1 - *first;
}

// Query token t, kv heads g0 .. g0 + heads_per_item - 1 (with every group of query heads that
// shares them), its key offsets in off; st streams the rows of the item's next token. A token
// whose rows a previous token's Streamer requested (streamed_in) asks for none itself.
void attend_token(const AttentionJob& j, int64_t t, int64_t g0, int64_t n, const int64_t* off, bool streamed_in,
                  Streamer& st) {
  const int64_t group = j.num_heads / j.num_kv_heads, d = j.d;
  const int64_t stride = (n + 15) / 16 * 16;  // each head's scores padded to whole vectors
  thread_local std::vector<float> sc, qs;
  sc.resize(stride);
  qs.resize(d);
  Prefetch pf;
  if (!streamed_in) {
    pf = Prefetch{j.k + g0 * d, j.v + g0 * d, j.heads_per_item * d};
    for (int64_t i = 0; i < std::min(n, kPrefetchRows); ++i) prefetch_row(pf.k + off[i], pf.width);
  }
  for (int64_t g = g0; g < g0 + j.heads_per_item; ++g) {
    const float* k = j.k + g * d;
    const float* v = j.v + g * d;
    for (int64_t a = 0; a < group; ++a) {
      const int64_t head = g * group + a;
      const float* src = j.q + (t * j.num_heads + head) * d;
      for (int64_t i = 0; i < d; ++i) qs[i] = src[i] * j.scale;
      float* s = sc.data();
      scores(qs.data(), k, off, n, d, s, pf, st);
      pf = Prefetch{};
      for (int64_t i = n; i < stride; ++i) s[i] = -INFINITY;
      softmax(s, stride);
      weighted_sum(s, v, off, n, d, j.out + (t * j.num_heads + head) * d, st);
    }
  }
}

// One work item: query tokens [item * tokens_per_item, ...) (at most tokens_per_item of them)
// and kv heads g0 .. g0 + heads_per_item - 1.
void attend(void* ctx, int64_t item) {
  const AttentionJob& j = *static_cast<const AttentionJob*>(ctx);
  const int64_t items_per_run = j.num_kv_heads / j.heads_per_item;
  const int64_t run = item / items_per_run, g0 = item % items_per_run * j.heads_per_item;
  const int64_t t_begin = run * j.tokens_per_item, t_end = std::min(j.num_tokens, t_begin + j.tokens_per_item);
  const int64_t row_stride = j.num_kv_heads * j.d;
  thread_local std::vector<int64_t> off, next_off;
  int64_t first, n;
  visible_keys(j, t_begin, &first, &n);
  off.resize(n);
  key_offsets(j.tables + j.token_seq[t_begin] * j.max_blocks, j.block_size, first, n, row_stride, off.data());
  for (int64_t t = t_begin; t < t_end; ++t) {
    Streamer st;
    int64_t next_first = 0, next_n = 0;
    if (t + 1 < t_end) {
      visible_keys(j, t + 1, &next_first, &next_n);
      next_off.resize(next_n);
      key_offsets(j.tables + j.token_seq[t + 1] * j.max_blocks, j.block_size, next_first, next_n, row_stride,
                  next_off.data());
      st.start(j.k + g0 * j.d, j.v + g0 * j.d, next_off.data(), next_n, j.heads_per_item * j.d * 4);
    }
    attend_token(j, t, g0, n, off.data(), t > t_begin, st);
    if (t + 1 < t_end) {
      off.swap(next_off);
      n = next_n;
    }
  }
}

}  // namespace

// Attention of q [T, h, d] into out (T * h * d floats), the caches' checks included.
void paged_attention_into(const paddle::Tensor& q_in, const paddle::Tensor& k_cache, const paddle::Tensor& v_cache,
                          const paddle::Tensor& query_start, const paddle::Tensor& seq_lens,
                          const paddle::Tensor& block_tables, float scale, int64_t sliding_window, float* out) {
  PD_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: none)");
  PD_CHECK(q_in.dtype() == paddle::DataType::FLOAT32 && q_in.shape().size() == 3, "q must be float32 [T, h, d]");
  const int64_t T = q_in.shape()[0], h = q_in.shape()[1], d = q_in.shape()[2];
  PD_CHECK(k_cache.shape().size() == 4, "k_cache must be [num_blocks, block_size, kvh, d]");
  const int64_t kvh = k_cache.shape()[2], block_size = k_cache.shape()[1];
  check_cache(k_cache, "k_cache", kvh, d);
  check_cache(v_cache, "v_cache", kvh, d);
  PD_CHECK(h % kvh == 0, "num_heads ", h, " is not a multiple of the cache's ", kvh, " KV heads");
  PD_CHECK(query_start.dtype() == paddle::DataType::INT64 && seq_lens.dtype() == paddle::DataType::INT64 &&
               block_tables.dtype() == paddle::DataType::INT64,
           "query_start, seq_lens and block_tables must be int64");
  const int64_t B = seq_lens.numel();
  PD_CHECK(query_start.numel() == B + 1, "query_start must have one more entry than seq_lens");
  PD_CHECK(block_tables.shape().size() == 2 && block_tables.shape()[0] == B, "block_tables must be [B, max_blocks]");
  const int64_t max_blocks = block_tables.shape()[1], num_blocks = k_cache.shape()[0];
  const int64_t* qs = query_start.data<int64_t>();
  const int64_t* lens = seq_lens.data<int64_t>();
  const int64_t* tables = block_tables.data<int64_t>();
  PD_CHECK(qs[0] == 0 && qs[B] == T, "query_start must run from 0 to the ", T, " query tokens");
  std::vector<int64_t> token_seq(T), token_pos(T);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qs[b + 1] - qs[b];
    PD_CHECK(q_len >= 0 && lens[b] >= q_len, "sequence ", b, ": ", q_len, " new tokens but seq_len ", lens[b]);
    PD_CHECK((lens[b] + block_size - 1) / block_size <= max_blocks, "sequence ", b, " needs more blocks than its table");
    for (int64_t p = 0; p < (lens[b] + block_size - 1) / block_size; ++p)
      PD_CHECK(tables[b * max_blocks + p] >= 0 && tables[b * max_blocks + p] < num_blocks, "sequence ", b,
               " block table entry ", p, " = ", tables[b * max_blocks + p], " outside the cache's ", num_blocks,
               " blocks");
    for (int64_t i = 0; i < q_len; ++i) {
      token_seq[qs[b] + i] = b;
      token_pos[qs[b] + i] = lens[b] - q_len + i;
    }
  }
  const paddle::Tensor q = q_in.contiguous();
  AttentionJob job{q.data<float>(),  k_cache.data<float>(), v_cache.data<float>(), token_seq.data(),
                   token_pos.data(), tables,                max_blocks,            block_size,
                   h,                kvh,                   d,                     sliding_window,
                   kvh,              1,                     T,
                   scale,            out};
  // Whole cache rows per item (one sequential stream the hardware prefetcher follows; 0.68 ->
  // 0.57 ms per layer for 64 decodes of 103 keys) unless there are too few query tokens to
  // keep the threads busy and enough keys to be worth waking them: then one item per kv head.
  int64_t keys = 0;
  for (int64_t t = 0; t < T; ++t) keys += token_pos[t] + 1;
  const int64_t threads = fd_kernels::Pool::instance().threads();
  if (T < 2 * threads && keys * kvh >= kSplitKeys) {
    job.heads_per_item = 1;
  } else {
    // Runs of tokens (the next one's rows stream in while one computes), ~4 items per thread.
    job.tokens_per_item = std::max<int64_t>(1, std::min<int64_t>(kTokensPerItem, T / (4 * threads)));
  }
  const int64_t runs = (T + job.tokens_per_item - 1) / job.tokens_per_item;
  fd_kernels::Pool::instance().run(runs * (kvh / job.heads_per_item), attend, &job);
}

std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                           const paddle::Tensor& v_cache, const paddle::Tensor& query_start,
                                           const paddle::Tensor& seq_lens, const paddle::Tensor& block_tables,
                                           float scale, int64_t sliding_window) {
  PD_CHECK(q.shape().size() == 3, "q must be float32 [T, h, d]");
  auto out = fd_graph::empty(q.shape(), paddle::DataType::FLOAT32);
  fd_graph::run("fd_paged_attention", {&q, &k_cache, &v_cache, &query_start, &seq_lens, &block_tables}, {&out},
                [=]() mutable {
                  paged_attention_into(q, k_cache, v_cache, query_start, seq_lens, block_tables, scale,
                                       sliding_window, out.data<float>());
                });
  return {out};
}

// fd_rope_paged_attention: fd_rope_write_kv then fd_paged_attention in one call, returning
// [T, h * d] (what the layer's output projection reads): one op dispatch per layer instead of
// two plus a reshape.
std::vector<paddle::Tensor> RopePagedAttention(const paddle::Tensor& qkv, const paddle::Tensor& positions,
                                               const paddle::Tensor& cos_sin, const paddle::Tensor& k_cache,
                                               const paddle::Tensor& v_cache, const paddle::Tensor& slots,
                                               const paddle::Tensor& query_start, const paddle::Tensor& seq_lens,
                                               const paddle::Tensor& block_tables, int64_t num_heads,
                                               int64_t num_kv_heads, float scale, int64_t sliding_window) {
  const int64_t d = check_rope(qkv, positions, cos_sin, k_cache, v_cache, slots, num_heads, num_kv_heads);
  const int64_t T = qkv.shape()[0];
  auto q = fd_graph::empty({T, num_heads, d}, paddle::DataType::FLOAT32);
  auto out = fd_graph::empty({T, num_heads * d}, paddle::DataType::FLOAT32);
  fd_graph::run("fd_rope_paged_attention",
                {&qkv, &positions, &cos_sin, &k_cache, &v_cache, &slots, &query_start, &seq_lens, &block_tables},
                {&q, &out}, [=]() mutable {
                  rope_write_kv_into(qkv, positions, cos_sin, k_cache, v_cache, slots, num_heads, num_kv_heads, d,
                                     q.data<float>());
                  paged_attention_into(q, k_cache, v_cache, query_start, seq_lens, block_tables, scale,
                                       sliding_window, out.data<float>());
                });
  return {out};
}

std::vector<std::vector<int64_t>> RopePagedAttentionShape(const std::vector<int64_t>& qkv, const std::vector<int64_t>&,
                                                          const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                          const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                          const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                          const std::vector<int64_t>&, int64_t num_heads,
                                                          int64_t num_kv_heads, float, int64_t) {
  return {{qkv[0], qkv[1] / (num_heads + 2 * num_kv_heads) * num_heads}};
}

std::vector<paddle::DataType> RopePagedAttentionDtype(const paddle::DataType&, const paddle::DataType&,
                                                      const paddle::DataType&, const paddle::DataType&,
                                                      const paddle::DataType&, const paddle::DataType&,
                                                      const paddle::DataType&, const paddle::DataType&,
                                                      const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

std::vector<std::vector<int64_t>> RopeWriteKvShape(const std::vector<int64_t>& qkv, const std::vector<int64_t>&,
                                                   const std::vector<int64_t>& cos_sin, const std::vector<int64_t>&,
                                                   const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                   int64_t num_heads, int64_t) {
  return {{qkv[0], num_heads, cos_sin[2]}};
}

std::vector<paddle::DataType> RopeWriteKvDtype(const paddle::DataType&, const paddle::DataType&,
                                               const paddle::DataType&, const paddle::DataType&,
                                               const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

std::vector<std::vector<int64_t>> PagedAttentionShape(const std::vector<int64_t>& q, const std::vector<int64_t>&,
                                                      const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                      const std::vector<int64_t>&, const std::vector<int64_t>&, float,
                                                      int64_t) {
  return {q};
}

std::vector<paddle::DataType> PagedAttentionDtype(const paddle::DataType&, const paddle::DataType&,
                                                  const paddle::DataType&, const paddle::DataType&,
                                                  const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(fd_rope_write_kv)
    .Inputs({"QKV", "Positions", "CosSin", "KCache", "VCache", "Slots"})
    .Outputs({"Q"})
    .Attrs({"num_heads: int64_t", "num_kv_heads: int64_t"})
    .SetKernelFn(PD_KERNEL(RopeWriteKv))
    .SetInferShapeFn(PD_INFER_SHAPE(RopeWriteKvShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RopeWriteKvDtype));

PD_BUILD_OP(fd_paged_attention)
    .Inputs({"Q", "KCache", "VCache", "QueryStart", "SeqLens", "BlockTables"})
    .Outputs({"Out"})
    .Attrs({"scale: float", "sliding_window: int64_t"})
    .SetKernelFn(PD_KERNEL(PagedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(PagedAttentionShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PagedAttentionDtype));

PD_BUILD_OP(fd_rope_paged_attention)
    .Inputs({"QKV", "Positions", "CosSin", "KCache", "VCache", "Slots", "QueryStart", "SeqLens", "BlockTables"})
    .Outputs({"Out"})
    .Attrs({"num_heads: int64_t", "num_kv_heads: int64_t", "scale: float", "sliding_window: int64_t"})
    .SetKernelFn(PD_KERNEL(RopePagedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(RopePagedAttentionShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RopePagedAttentionDtype));
