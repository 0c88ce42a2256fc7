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
//   itself included: keys p > position - w, as HF's Mistral), read block by block through
//   block_tables. Tiled (see "tiled attention" below): a work item is a block of query tokens of
//   one sequence with every query head of one KV head, walking its keys in 64-key tiles with an
//   online softmax, so scores never leave the cache and each key/value row is read once per
//   item; causal tiles past the item are skipped; a step with too few items for the threads
//   (a few long decodes) splits each item's keys and combines the partial softmax results.
//   Softmax in float32 with the running maximum subtracted.
//
// The caches are [num_blocks, block_size, kvh, d] float32 or bfloat16 (--kv-cache-dtype
// bfloat16) and are written in place: they are the engine's long-lived KV buffers, not values of
// a graph (the ops run eagerly on the cpu). A bfloat16 cache stores the float32 keys and values
// rounded to nearest, ties to even (Paddle's cast), and attention over it multiplies in bfloat16
// and adds in float32 (queries and softmax weights rounded to bfloat16; bf16_attention.h: the
// formula and its two paths, vdpbf16ps or widening; `bf16_path` picks one as fd_bf16_linear's).
// On CPUs with AMX-BF16 the wide items (prompt chunks) multiply in AMX tiles (amx_attention.h),
// after a self-check of the tiles in a forked child; narrow items (decodes) keep vdpbf16ps.
// `bf16_path`: 0 the CPU's best, 1 widen, 2 vdpbf16ps, 3 AMX tiles for wide items, 4 the same on
// the software model of the tiles (tests).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paddle/extension.h"
#include "graph.h"
#include "amx_attention.h"
#include "bf16_attention.h"
#include "line_buffer.h"
#include "thread_pool.h"
#include "vector_math.h"

namespace {

using fd_kernels::axpy;
using fd_kernels::dot;
using fd_kernels::exp16;
using fd_kernels::f32x16;
using fd_kernels::hsum;
using fd_kernels::i32x16;
using fd_kernels::load16;
using fd_kernels::select;
using fd_kernels::splat;
using fd_kernels::store16;

// float32 -> bfloat16, round to nearest, ties to even; a NaN becomes 0x7fff (as Paddle's cast).
inline uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline void round_bf16(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {  // to_bf16 on 16 lanes: the shared rounding, a NaN as Paddle's 0x7fff
    const fd_kernels::u32x16 u = fd_kernels::load<fd_kernels::u32x16>(reinterpret_cast<const uint32_t*>(x + i));
    const fd_kernels::u32x16 bits =
        select((u & 0x7fffffffu) > 0x7f800000u, fd_kernels::u32x16{} + 0x7fffu, fd_kernels::round_bf16_lanes(u) >> 16u);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16((__m512i)bits));
  }
#endif
  for (; i < n; ++i) out[i] = to_bf16(x[i]);
}

// bfloat16 -> float32 (exact: a bfloat16 is the upper half of a float32).
inline void widen_bf16(const uint16_t* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
#endif
  for (; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(out + i, &u, sizeof(u));
  }
}

inline bool is_bf16(const paddle::Tensor& cache) { return cache.dtype() == paddle::DataType::BFLOAT16; }

inline void rotate(const float* x, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

void check_cache(const paddle::Tensor& cache, const char* name, int64_t kvh, int64_t d) {
  PD_CHECK((cache.dtype() == paddle::DataType::FLOAT32 || is_bf16(cache)) && cache.shape().size() == 4, name,
           " must be float32 or bfloat16 [num_blocks, block_size, kvh, d]");
  PD_CHECK(cache.shape()[2] == kvh && cache.shape()[3] == d, name, " has ", cache.shape()[2], " heads of ",
           cache.shape()[3], ", expected ", kvh, " of ", d);
}

}  // namespace

namespace {

// Tokens from which fd_rope_write_kv spreads its work over the pool.
constexpr int64_t kPoolTokens = 64;

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
  PD_CHECK(k_cache.dtype() == v_cache.dtype(), "k_cache and v_cache must have one dtype");
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
  // In place: see the file comment. A bfloat16 cache gets each rotated key row rounded from `row_k`.
  const bool bf16 = is_bf16(k_cache);
  void* kc = const_cast<void*>(k_cache.data());
  void* vc = const_cast<void*>(v_cache.data());
  for (int64_t t = 0; t < T; ++t) {
    PD_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the rotary table of ", max_pos);
    PD_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " outside the cache of ", num_slots, " slots");
  }
  const auto tokens = [=](int64_t t0, int64_t t1) {
    thread_local fd_kernels::LineBuffer<float> row_k;
    row_k.resize(d);
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = xp + t * width;
      const float* cos = table + pos[t] * 2 * d;
      const float* sin = cos + d;
      for (int64_t h = 0; h < num_heads; ++h) rotate(row + h * d, cos, sin, qp + (t * num_heads + h) * d, d);
      const int64_t at = slot[t] * num_kv_heads * d;
      const float* v_src = row + (num_heads + num_kv_heads) * d;
      if (bf16) {
        uint16_t* k_dst = static_cast<uint16_t*>(kc) + at;
        for (int64_t g = 0; g < num_kv_heads; ++g) {
          rotate(row + (num_heads + g) * d, cos, sin, row_k.data(), d);
          round_bf16(row_k.data(), k_dst + g * d, d);
        }
        round_bf16(v_src, static_cast<uint16_t*>(vc) + at, num_kv_heads * d);
        continue;
      }
      float* k_dst = static_cast<float*>(kc) + at;
      for (int64_t g = 0; g < num_kv_heads; ++g) rotate(row + (num_heads + g) * d, cos, sin, k_dst + g * d, d);
      std::memcpy(static_cast<float*>(vc) + at, v_src, num_kv_heads * d * sizeof(float));
    }
  };
  // A few tokens (decodes) on the calling thread; a prompt's 16 at a time on the pool (a
  // 2,048-token prompt step spent ~7% of its time here on one thread while the other waited).
  // Tokens write disjoint slots (the engine's slot mapping), so their order does not matter.
  if (T < kPoolTokens) return tokens(0, T);
  fd_kernels::run_row_chunks<16>(T, tokens);
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

// ---- tiled attention --------------------------------------------------------------------------
//
// One work item is a block of consecutive query tokens of one sequence and one kv head, with
// every query head of that kv head's group: its rows (token x group head) share each key and
// value row, so a row of the cache is read once per item, not once per query head and token.
// The item walks its keys in tiles of kKeyTile with an online softmax (a running maximum and sum
// per row, the partial output rescaled when the maximum grows): a tile's scores, the rows'
// queries and outputs stay in L1/L2 whatever the context length. Key tiles past the item's last
// position (causal) or before its first row's window are never visited; a tile that every row
// sees whole is not masked. When there are too few items to keep the threads busy (decode of a
// few long sequences), an item's keys are split into ranges computed as separate items and
// their partial results (output, maximum, sum per row) are combined afterwards.

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
#elif defined(__AVX2__)
  // The halves' sum per vector, then the same tree on 8 lanes: hadd pairs neighbours, twice,
  // leaving each 128-bit lane with four vectors' partial sums; the two lanes are added last.
  __m256 t[16];
  for (int i = 0; i < 16; ++i) t[i] = (__m256)(v[i].lo + v[i].hi);
  f32x16 r;
  for (int half = 0; half < 2; ++half) {
    const __m256* u = t + 8 * half;
    const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(u[0], u[1]), _mm256_hadd_ps(u[2], u[3]));
    const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(u[4], u[5]), _mm256_hadd_ps(u[6], u[7]));
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
    (half == 0 ? r.lo : r.hi) = (f32x16::Half)sums;
  }
  return r;
#else
  f32x16 r{};
  for (int i = 0; i < 16; ++i) r[i] = hsum(v[i]);
  return r;
#endif
}


// Keys per tile.
constexpr int64_t kKeyTile = 64;
// Keys per tile of an item multiplied in AMX tiles: a tile's fixed costs (the output's rescaling,
// the maxima, the tiles' set-up) over twice the keys. (A 2,048-token prompt's attention on a Xeon
// with AMX: see benchmarks/perf_cpu.md.)
constexpr int64_t kTileKeyTile = 128;
// Query rows (tokens x query heads of one kv head) per work item, at most.
constexpr int64_t kRowsPerItem = 64;
// Items per thread a job aims at before splitting items' keys.
constexpr int64_t kItemsPerThread = 4;
// Fewest keys a split range gets.
constexpr int64_t kMinSplitKeys = 512;
// Items with fewer rows compute scores row by row (dot products over key rows, 16 keys summed
// in one tree); wider items broadcast key elements against their transposed queries (16 rows
// per vector), which wastes lanes when the rows do not fill them.
constexpr int64_t kNarrowRows = 12;

// Each row's largest score of a tile, mx[r] = max over jj < nk of st[jj * mp + r] (NaN never
// taken; -inf when nk = 0), for rows r < mp (a multiple of 16): NV vectors of 16 rows side by
// side, so their maxima are NV independent chains of compares (one vector at a time, a tile of
// 128 keys was 128 dependent compares per vector: ~5% of a prompt's attention on a Xeon).
template <int NV>
void tile_maxima_rows(const float* st, int64_t nk, int64_t mp, int64_t rv0, float* mx) {
  f32x16 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = f32x16{} - INFINITY;
  for (int64_t jj = 0; jj < nk; ++jj)
    for (int v = 0; v < NV; ++v) {
      const f32x16 s = load16(st + jj * mp + rv0 + 16 * v);
      acc[v] = select(s > acc[v], s, acc[v]);
    }
  for (int v = 0; v < NV; ++v) store16(mx + rv0 + 16 * v, acc[v]);
}

void tile_maxima(const float* st, int64_t nk, int64_t mp, float* mx) {
  for (int64_t rv0 = 0; rv0 < mp; rv0 += 64) {
    switch (std::min<int64_t>(64, mp - rv0) / 16) {
      case 4: tile_maxima_rows<4>(st, nk, mp, rv0, mx); break;
      case 3: tile_maxima_rows<3>(st, nk, mp, rv0, mx); break;
      case 2: tile_maxima_rows<2>(st, nk, mp, rv0, mx); break;
      default: tile_maxima_rows<1>(st, nk, mp, rv0, mx); break;
    }
  }
}

struct Item {
  int64_t seq, t_begin, t_end, g;
  int64_t k_lo, k_hi;  // keys k_lo .. k_hi (inclusive) are visited
  int64_t partial;     // -1: the item writes the output; else its slot in the partial buffers
  int64_t heads = 1;   // kv heads g .. g + heads - 1 (more than one: a decode token, see below)
};

// A decode token's item may hold the query heads of several kv heads (every head of the token
// when the group is small): the rows of a decode item otherwise fill 3 of a vector's 16 lanes at
// SmolLM2's group of 3, and the online softmax, the masks and the per-item set-up cost per
// vector, not per row. Each row's arithmetic is unchanged (its scores, weights and output are
// computed by the same code in the same order, lane by lane), so the results are the same bits
// either way. Only on the paths that compute a tile's scores and weighted values per row group
// (float32 cache; bfloat16 cache with vdpbf16ps), and only when the step has enough decode tokens
// to keep the threads busy without splitting keys.
inline int64_t decode_heads_per_item(int64_t group, int64_t kvh) {
  return std::max<int64_t>(1, std::min<int64_t>(kvh, (kNarrowRows - 1) / group));
}

// Whether a narrow item's scores and weighted values are computed per group of rows on this
// cache (what a grouped item needs): float32, or bfloat16 multiplied by vdpbf16ps at head size d
// (attend_item's dot_scores and dot_pv); not the widening path, whose tile copies hold one head.
inline bool narrow_per_head_group(bool bf16, bool bf16_dot, int64_t d) {
  return !bf16 || (bf16_dot && fd_bf16_attention::narrow_takes(d) && fd_bf16_attention::pv_takes(d));
}

struct AttentionJob {
  const float* q;  // [T, h, d]
  const float* k;  // cache [NB, bs, kvh, d], float32 (nullptr for a bfloat16 cache)
  const float* v;
  const uint16_t* k16;  // cache [NB, bs, kvh, d], bfloat16 (nullptr for a float32 cache)
  const uint16_t* v16;
  const int64_t* token_pos;  // [T]: position of each query token (keys 0..pos are visible)
  const int64_t* tables;     // [B, MB]
  int64_t max_blocks, block_size, num_heads, num_kv_heads, d, window, group, rows_max;
  bool bf16_dot;  // a bfloat16 cache: multiply with vdpbf16ps (else widen the tiles)
  fd_amx_attention::Mode tiles;  // a bfloat16 cache: wide items multiply in AMX tiles (or their model)
  float scale;
  float* out;  // [T, h, d]
  const Item* items;
  float* part_o;   // [partials, rows_max, d]: unnormalised outputs of split items
  float* part_ml;  // [partials, rows_max, 2]: their maxima and sums
};

// Scores st[j * mp + r] = q_r . key_j for rows r < mp (queries transposed: qt[c * mp + r]) and
// keys j < nk at k + off[j]: 4 keys x NV vectors of 16 rows per pass, a key element broadcast
// against NV row vectors.
template <int NV>
void scores_wide_pass(const float* qt, int64_t mp, int64_t rv0, const float* k, const int64_t* off, int64_t nk,
                      int64_t d, float* st) {
  for (int64_t j0 = 0; j0 < nk; j0 += 4) {
    const int64_t nj = std::min<int64_t>(4, nk - j0);
    const float* kr[4];
    for (int64_t jj = 0; jj < 4; ++jj) kr[jj] = k + off[j0 + std::min(jj, nj - 1)];
    f32x16 acc[4][NV] = {};
    for (int64_t c = 0; c < d; ++c) {
      f32x16 qv[NV];
      for (int n = 0; n < NV; ++n) qv[n] = load16(qt + c * mp + (rv0 + n) * 16);
      for (int jj = 0; jj < 4; ++jj) {
        const f32x16 b = splat(kr[jj][c]);
        for (int n = 0; n < NV; ++n) acc[jj][n] += b * qv[n];
      }
    }
    for (int64_t jj = 0; jj < nj; ++jj)
      for (int n = 0; n < NV; ++n) store16(st + (j0 + jj) * mp + (rv0 + n) * 16, acc[jj][n]);
  }
}

void scores_wide(const float* qt, int64_t mp, const float* k, const int64_t* off, int64_t nk, int64_t d, float* st) {
  const int64_t vectors = mp / 16;
  for (int64_t rv0 = 0; rv0 < vectors; rv0 += 4) {
    switch (std::min<int64_t>(4, vectors - rv0)) {
      case 1: scores_wide_pass<1>(qt, mp, rv0, k, off, nk, d, st); break;
      case 2: scores_wide_pass<2>(qt, mp, rv0, k, off, nk, d, st); break;
      case 3: scores_wide_pass<3>(qt, mp, rv0, k, off, nk, d, st); break;
      default: scores_wide_pass<4>(qt, mp, rv0, k, off, nk, d, st); break;
    }
  }
}

// The same scores for few rows (queries as rows, qr[r * d + c]), head size 16 * D16: 16 keys'
// partial products in 16 vectors, then one tree of sums.
template <int D16>
void scores_narrow_fixed(const float* qr, int64_t m, int64_t mp, const float* k, const int64_t* off, int64_t nk,
                         float* st) {
  for (int64_t r = 0; r < m; ++r) {
    f32x16 qv[D16];
    for (int c = 0; c < D16; ++c) qv[c] = load16(qr + r * 16 * D16 + 16 * c);
    for (int64_t j0 = 0; j0 < nk; j0 += 16) {
      const int64_t n = std::min<int64_t>(16, nk - j0);
      f32x16 part[16];
      for (int64_t j = 0; j < n; ++j) {
        const float* row = k + off[j0 + j];
        f32x16 acc = qv[0] * load16(row);
        for (int c = 1; c < D16; ++c) acc += qv[c] * load16(row + 16 * c);
        part[j] = acc;
      }
      for (int64_t j = n; j < 16; ++j) part[j] = f32x16{};
      const f32x16 s = sum16(part);
      for (int64_t j = 0; j < n; ++j) st[(j0 + j) * mp + r] = s[j];
    }
  }
}

// Rows 0 .. m - 1 of st (stride mp) only: a grouped decode item calls it once per kv head.
void scores_narrow_rows(const float* qr, int64_t m, int64_t mp, const float* k, const int64_t* off, int64_t nk,
                        int64_t d, float* st) {
  switch (d) {
    case 16: return scores_narrow_fixed<1>(qr, m, mp, k, off, nk, st);
    case 32: return scores_narrow_fixed<2>(qr, m, mp, k, off, nk, st);
    case 64: return scores_narrow_fixed<4>(qr, m, mp, k, off, nk, st);
    case 128: return scores_narrow_fixed<8>(qr, m, mp, k, off, nk, st);
    default:
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < nk; ++j) st[j * mp + r] = dot(qr + r * d, k + off[j], d);
  }
}

// Padding rows m .. mp - 1 of st zeroed (finite, never read back).
inline void zero_padding_rows(float* st, int64_t m, int64_t mp, int64_t nk) {
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t r = m; r < mp; ++r) st[j * mp + r] = 0.f;
}

// o[r] = o[r] * alpha[r] + sum_j p[j * mp + r] * value_j for rows r0 .. r0 + R - 1, head size
// 16 * D16, the R output rows held in registers over the tile's keys.
template <int D16, int R>
void pv_rows(const float* p, int64_t mp, int64_t r0, const float* v, const int64_t* off, int64_t nk,
             const float* alpha, float* o) {
  constexpr int64_t d = 16 * D16;
  f32x16 acc[R][D16];
  for (int rr = 0; rr < R; ++rr)
    for (int c = 0; c < D16; ++c) acc[rr][c] = load16(o + (r0 + rr) * d + 16 * c) * alpha[r0 + rr];
  for (int64_t j = 0; j < nk; ++j) {
    const float* row = v + off[j];
    f32x16 vv[D16];
    for (int c = 0; c < D16; ++c) vv[c] = load16(row + 16 * c);
    for (int rr = 0; rr < R; ++rr) {
      const f32x16 w = splat(p[j * mp + r0 + rr]);
      for (int c = 0; c < D16; ++c) acc[rr][c] += w * vv[c];
    }
  }
  for (int rr = 0; rr < R; ++rr)
    for (int c = 0; c < D16; ++c) store16(o + (r0 + rr) * d + 16 * c, acc[rr][c]);
}

template <int D16>
void pv_fixed(const float* p, int64_t m, int64_t mp, const float* v, const int64_t* off, int64_t nk,
              const float* alpha, float* o) {
#if defined(__AVX512F__)
  // R x D16 accumulators, at most 24 of the 32 registers (with the value row's D16 and the
  // weight): each value row read from L1 once per R rows. The rows left over are one call of
  // their count (a grouped decode item's 3 rows per kv head, a prompt item's 63 rows: 10 x 6 + 3),
  // not one call per row. Each row's sums are the same chain whatever R is. 4 rows per call
  // before: a 2,048-token prompt's attention, 30 layers, float32 cache, ~5% more time.
  constexpr int R = D16 <= 4 ? 6 : 3;
  int64_t r0 = 0;
  for (; r0 + R <= m; r0 += R) pv_rows<D16, R>(p, mp, r0, v, off, nk, alpha, o);
  switch (m - r0) {
    case 5: return pv_rows<D16, 5>(p, mp, r0, v, off, nk, alpha, o);
    case 4: return pv_rows<D16, 4>(p, mp, r0, v, off, nk, alpha, o);
    case 3: return pv_rows<D16, 3>(p, mp, r0, v, off, nk, alpha, o);
    case 2: return pv_rows<D16, 2>(p, mp, r0, v, off, nk, alpha, o);
    case 1: return pv_rows<D16, 1>(p, mp, r0, v, off, nk, alpha, o);
    default: return;
  }
#else
  // AVX2: a 16-float vector is two of the 16 ymm registers. 4 rows of a 64-wide head (32
  // accumulator registers) spilled at every key; one row keeps 8 and takes the value rows as
  // memory operands (from L1: the tile's rows were just read). Each row's sums are the same
  // chain either way. 30 layers at 280 keys, 5 query tokens: 4.6 -> 3.2 ms (EPYC 7002).
  constexpr int R = D16 >= 4 ? 1 : D16 == 2 ? 2 : 4;
  int64_t r0 = 0;
  for (; r0 + R <= m; r0 += R) pv_rows<D16, R>(p, mp, r0, v, off, nk, alpha, o);
  for (; r0 < m; ++r0) pv_rows<D16, 1>(p, mp, r0, v, off, nk, alpha, o);
#endif
}

void pv(const float* p, int64_t m, int64_t mp, const float* v, const int64_t* off, int64_t nk, int64_t d,
        const float* alpha, float* o) {
  switch (d) {
    case 16: return pv_fixed<1>(p, m, mp, v, off, nk, alpha, o);
    case 32: return pv_fixed<2>(p, m, mp, v, off, nk, alpha, o);
    case 48: return pv_fixed<3>(p, m, mp, v, off, nk, alpha, o);
    case 64: return pv_fixed<4>(p, m, mp, v, off, nk, alpha, o);
    case 128: return pv_fixed<8>(p, m, mp, v, off, nk, alpha, o);
    default:
      for (int64_t r = 0; r < m; ++r) {
        float* orow = o + r * d;
        for (int64_t c = 0; c < d; ++c) orow[c] *= alpha[r];
        for (int64_t j = 0; j < nk; ++j) axpy(p[j * mp + r], v + off[j], orow, d);
      }
  }
}

void attend_item(void* ctx, int64_t index) {
  const AttentionJob& j = *static_cast<const AttentionJob*>(ctx);
  const Item& it = j.items[index];
  const int64_t group = j.group, d = j.d, h = j.num_heads;
  // Rows: token-major, then the query heads of kv heads it.g .. it.g + it.heads - 1.
  const int64_t token_rows = group * it.heads;
  const int64_t m = (it.t_end - it.t_begin) * token_rows, mp = (m + 15) / 16 * 16;
  const bool narrow = m < kNarrowRows;
  // Rows per kv head call of the narrow paths: a grouped (single-token) item's group per head.
  const int64_t head_rows = it.heads > 1 ? group : m;
  // Every buffer read or written a vector at a time starts on a cache line (line_buffer.h; the
  // AMX tiles' st and operands need it too): from a 16-byte aligned std::vector the queries'
  // loads spanned two lines each, and a 2,048-token prompt's attention took 6-15% longer.
  thread_local fd_kernels::LineBuffer<float> qr, qt, o, mv, lv, av, kw, vw, tile_max;
  thread_local fd_amx::TileBuffer<float> st;  // the tile's scores (stored into by AMX tiles)
  thread_local fd_kernels::LineBuffer<int32_t> row_pos;
  thread_local std::vector<int64_t> off, wide_off, next_off;
  thread_local fd_amx::TileBuffer<uint32_t> qp, pp, vp;  // tile operands
  thread_local fd_kernels::LineBuffer<uint16_t> qb;
  // A bfloat16 cache: queries rounded to bfloat16 (bf16_attention.h); with vdpbf16ps the scores
  // and the weighted values read the cached rows as they are, else the tile's rows are widened.
  const bool bf16 = j.k16 != nullptr;
  // AMX tiles (amx_attention.h) for a wide item: the query pairs over mq columns (32 per B tile),
  // the keys gathered into key_rows, the weights and values packed as key pairs (wa, vp).
  const bool tiles = bf16 && !narrow && j.tiles != fd_amx_attention::Mode::kOff && fd_amx_attention::takes(d);
  thread_local fd_amx::TileBuffer<uint16_t> key_rows;
  thread_local fd_amx::TileBuffer<uint32_t> wa;
  const fd_amx_attention::ItemTiles item_tiles(tiles ? j.tiles : fd_amx_attention::Mode::kOff);
  const int64_t mq = tiles ? fd_amx_attention::query_columns(mp) : mp;
  const int64_t key_tile = tiles ? kTileKeyTile : kKeyTile;
  const bool dot_scores = !tiles && bf16 && j.bf16_dot && (!narrow || fd_bf16_attention::narrow_takes(d));
  const bool dot_pv = !tiles && bf16 && j.bf16_dot && fd_bf16_attention::pv_takes(d);
  qr.assign(mq * d, 0.f);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t t = it.t_begin + r / token_rows, head = it.g * group + r % token_rows;
    const float* src = j.q + (t * h + head) * d;
    float* dst = qr.data() + r * d;
    int64_t c = 0;
    for (; c + 16 <= d; c += 16) {
      const f32x16 scaled = load16(src + c) * j.scale;
      store16(dst + c, bf16 ? fd_bf16_attention::round_floats16(scaled) : scaled);
    }
    for (; c < d; ++c) dst[c] = bf16 ? fd_bf16_attention::round_float(src[c] * j.scale) : src[c] * j.scale;
  }
  if (tiles) {
    qp.resize(d / 2 * mq);
    fd_bf16_attention::pack_query_pairs(qr.data(), mq, d, qp.data());
  } else if (dot_scores && !narrow) {
    qp.resize(d / 2 * mp);
    fd_bf16_attention::pack_query_pairs(qr.data(), mp, d, qp.data());
  } else if (dot_scores) {
    qb.resize(m * d);
    fd_bf16_attention::pack_query_rows(qr.data(), m, d, qb.data());
  } else if (!narrow) {
    qt.resize(d * mp);
    for (int64_t r = 0; r < mp; ++r)
      for (int64_t c = 0; c < d; ++c) qt[c * mp + r] = qr[r * d + c];
  }
  row_pos.resize(mp);
  for (int64_t r = 0; r < mp; ++r) row_pos[r] = static_cast<int32_t>(j.token_pos[it.t_begin + std::min(r, m - 1) / token_rows]);
  st.resize(key_tile * mp);
  o.assign(m * d, 0.f);
  mv.assign(mp, -INFINITY);
  lv.assign(mp, 0.f);
  av.resize(mp);
  tile_max.resize(mp);
  off.resize(key_tile);
  next_off.resize(key_tile);
  const int64_t min_pos = j.token_pos[it.t_begin], max_pos = j.token_pos[it.t_end - 1];
  const int64_t* table = j.tables + it.seq * j.max_blocks;
  const int64_t row_stride = j.num_kv_heads * d;
  // A bfloat16 cache read without vdpbf16ps: each tile's key and value rows widened into
  // kw / vw (rows j * d); with it, the value rows packed as key pairs into vp.
  const float* k = bf16 ? kw.data() : j.k + it.g * d;
  const float* v = bf16 ? vw.data() : j.v + it.g * d;
  const uint16_t* k16 = bf16 ? j.k16 + it.g * d : nullptr;
  const uint16_t* v16 = bf16 ? j.v16 + it.g * d : nullptr;
  if (bf16) {
    kw.resize(key_tile * d);
    vw.resize(key_tile * d);
    wide_off.resize(key_tile);
    for (int64_t jj = 0; jj < key_tile; ++jj) wide_off[jj] = jj * d;
    k = kw.data(), v = vw.data();
    if (tiles) {
      key_rows.resize(fd_amx_attention::round_up(key_tile, 32) * d);
      wa.assign(fd_amx_attention::round_up(m, 32) * fd_amx_attention::weight_pairs(key_tile), 0u);
      vp.resize(fd_amx_attention::weight_pairs(key_tile) * d);
    }
    if (dot_pv) {
      pp.resize((key_tile / 2) * mp);
      vp.resize((key_tile / 2) * d);
    }
  }
  const int64_t* tile_off = bf16 ? wide_off.data() : off.data();
  const f32x16 neg_inf = f32x16{} - INFINITY;
  for (int64_t kb = it.k_lo; kb <= it.k_hi; kb += key_tile) {
    const int64_t nk = std::min(key_tile, it.k_hi + 1 - kb);
    key_offsets(table, j.block_size, kb, nk, row_stride, off.data());
    // A narrow item (decode tokens) asks for the next tile's key and value rows now: past L2's
    // reach (a kv head's keys and values at 8k context are ~2-4 MB) its strided rows otherwise
    // arrive one miss at a time. Not a wide item (12+ rows, prompt chunks), which keeps each
    // tile long enough for the hardware's own prefetch: the prefetches cost a prompt's attention
    // on AMX tiles ~5-8% (Xeon with AMX), on a float32 cache ~2-4% (Ice Lake Xeon).
    if (kb + key_tile <= it.k_hi && narrow) {
      const int64_t nn = std::min(key_tile, it.k_hi + 1 - kb - key_tile);
      key_offsets(table, j.block_size, kb + key_tile, nn, row_stride, next_off.data());
      const int64_t row_bytes = it.heads * d * (bf16 ? 2 : 4);
      const char* kbase = bf16 ? reinterpret_cast<const char*>(k16) : reinterpret_cast<const char*>(j.k + it.g * d);
      const char* vbase = bf16 ? reinterpret_cast<const char*>(v16) : reinterpret_cast<const char*>(j.v + it.g * d);
      const int64_t elem = bf16 ? 2 : 4;
      for (int64_t jj = 0; jj < nn; ++jj)
        for (int64_t b = 0; b < row_bytes; b += 64) {
          _mm_prefetch(kbase + next_off[jj] * elem + b, _MM_HINT_T1);
          _mm_prefetch(vbase + next_off[jj] * elem + b, _MM_HINT_T1);
        }
    }
    if (bf16 && !tiles) {
      for (int64_t jj = 0; jj < nk; ++jj) {
        if (!dot_scores) widen_bf16(k16 + off[jj], kw.data() + jj * d, d);
        if (!dot_pv) widen_bf16(v16 + off[jj], vw.data() + jj * d, d);
      }
    }
    if (tiles) {
      // Each 32 keys one block's consecutive rows: the A tiles read them in the cache.
      const bool in_place = j.block_size % 32 == 0 && kb % 32 == 0;
      if (!in_place) fd_amx_attention::gather_keys(k16, off.data(), nk, d, key_rows.data());
      const fd_amx_attention::KeyRows keys = in_place ? fd_amx_attention::KeyRows{k16, off.data(), row_stride}
                                                      : fd_amx_attention::KeyRows{key_rows.data(), nullptr, d};
      fd_amx_attention::scores(j.tiles, keys, nk, d, qp.data(), mq, mp, st.data());
    } else
#if defined(__x86_64__)
    if (dot_scores && narrow) {
      zero_padding_rows(st.data(), m, mp, nk);
      const auto tree = [](const f32x16* part) { return sum16(part); };
      for (int64_t gi = 0; gi < it.heads; ++gi) {
        const uint16_t* qg = qb.data() + gi * group * d;
        const uint16_t* kg = k16 + gi * d;
        float* sg = st.data() + gi * group;
        switch (d) {
          case 32: fd_bf16_attention::scores_narrow<1>(qg, head_rows, mp, kg, off.data(), nk, sg, tree); break;
          case 64: fd_bf16_attention::scores_narrow<2>(qg, head_rows, mp, kg, off.data(), nk, sg, tree); break;
          case 96: fd_bf16_attention::scores_narrow<3>(qg, head_rows, mp, kg, off.data(), nk, sg, tree); break;
          default: fd_bf16_attention::scores_narrow<4>(qg, head_rows, mp, kg, off.data(), nk, sg, tree); break;
        }
      }
    } else if (dot_scores) {
      fd_bf16_attention::scores_wide(qp.data(), mp, k16, off.data(), nk, d, st.data());
    } else
#endif
    if (narrow) {
      zero_padding_rows(st.data(), m, mp, nk);
      for (int64_t gi = 0; gi < it.heads; ++gi)
        scores_narrow_rows(qr.data() + gi * group * d, head_rows, mp, k + gi * d, tile_off, nk, d, st.data() + gi * group);
    } else {
      scores_wide(qt.data(), mp, k, tile_off, nk, d, st.data());
    }
    // Causal and window masks, only on tiles some row does not see whole.
    const bool whole = kb + nk - 1 <= min_pos && (j.window == 0 || kb > max_pos - j.window);
    if (!whole) {
      for (int64_t rv = 0; rv < mp; rv += 16) {
        i32x16 pos;
        pos = fd_kernels::load<i32x16>(row_pos.data() + rv);
        for (int64_t jj = 0; jj < nk; ++jj) {
          const int32_t kp = static_cast<int32_t>(kb + jj);
          i32x16 hidden = kp > pos;
          if (j.window > 0) hidden |= kp <= pos - static_cast<int32_t>(j.window);
          float* s = st.data() + jj * mp + rv;
          store16(s, select(hidden, neg_inf, load16(s)));
        }
      }
    }
    // Online softmax over the tile, 16 rows per vector.
    tile_maxima(st.data(), nk, mp, tile_max.data());
    for (int64_t rv = 0; rv < mp; rv += 16) {
      f32x16 mx = load16(tile_max.data() + rv);
      const f32x16 m_old = load16(mv.data() + rv);
      // A bfloat16 cache: maxima on the lattice of multiples of ln 2 (bf16_attention.h), so a
      // weight's rounding does not depend on the tiles seen before it.
      if (bf16) mx = fd_bf16_attention::ln2_ceiling(mx);
      const f32x16 m_new = select(mx > m_old, mx, m_old);
      // A row with no visible key yet keeps maximum -inf; subtracting 0 instead gives p = 0
      // and alpha = 0 (its sum and output are still 0) without inf - inf.
      const f32x16 m_use = select(m_new == neg_inf, f32x16{}, m_new);
      const f32x16 alpha = exp16(m_old - m_use);
      f32x16 sum{};
      if (tiles)  // the weights go straight into the tiles' key pairs
        sum = fd_amx_attention::exp_weight_rows(st.data(), nk, mp, rv, m, m_use, fd_amx_attention::weight_pairs(key_tile),
                                                wa.data());
      for (int64_t jj = 0; !tiles && jj < nk; ++jj) {
        float* s = st.data() + jj * mp + rv;
        const f32x16 p = exp16(load16(s) - m_use);
        store16(s, p);
        sum += p;
      }
      store16(lv.data() + rv, load16(lv.data() + rv) * alpha + sum);
      store16(mv.data() + rv, m_new);
      store16(av.data() + rv, alpha);
    }
    if (tiles) {
      const int64_t ps = fd_amx_attention::weight_pairs(key_tile);  // one stride for wa's zero rows past m
      fd_amx_attention::pack_value_rows(v16, off.data(), nk, d, ps, vp.data());
      fd_amx_attention::weighted_values(j.tiles, wa.data(), ps, m, vp.data(), d, av.data(), o.data());
      continue;
    }
#if defined(__x86_64__)
    if (dot_pv) {
      fd_bf16_attention::pack_weight_pairs(st.data(), nk, mp, pp.data());
      for (int64_t gi = 0; gi < it.heads; ++gi) {
        fd_bf16_attention::pack_value_pairs(v16 + gi * d, off.data(), nk, d, vp.data());
        fd_bf16_attention::pv(pp.data() + gi * group, head_rows, mp, vp.data(), nk, d, av.data() + gi * group,
                              o.data() + gi * group * d);
      }
      continue;
    }
#endif
    if (bf16) fd_bf16_attention::round_weights(st.data(), nk, mp);
    for (int64_t gi = 0; gi < it.heads; ++gi)
      pv(st.data() + gi * group, head_rows, mp, v + gi * d, tile_off, nk, d, av.data() + gi * group, o.data() + gi * group * d);
  }
  if (it.partial < 0) {
    for (int64_t r = 0; r < m; ++r) {
      const int64_t t = it.t_begin + r / token_rows, head = it.g * group + r % token_rows;
      float* dst = j.out + (t * h + head) * d;
      const float inv = 1.f / lv[r];
      for (int64_t c = 0; c < d; ++c) dst[c] = o[r * d + c] * inv;
    }
  } else {  // a split item: one kv head (grouped decode items are never split)
    std::memcpy(j.part_o + it.partial * j.rows_max * d, o.data(), m * d * sizeof(float));
    float* ml = j.part_ml + it.partial * j.rows_max * 2;
    for (int64_t r = 0; r < m; ++r) ml[2 * r] = mv[r], ml[2 * r + 1] = lv[r];
  }
}

// The output rows of an item whose keys were split into `count` ranges (partials first ..
// first + count - 1): the partial outputs weighted by exp(their maximum - the overall maximum),
// divided by the likewise weighted sum.
void combine_partials(const AttentionJob& j, const Item& it, int64_t first, int64_t count) {
  const int64_t group = j.group, d = j.d, m = (it.t_end - it.t_begin) * group;
  std::vector<float> weight(count);
  for (int64_t r = 0; r < m; ++r) {
    float m_all = -INFINITY;
    for (int64_t s = 0; s < count; ++s) m_all = std::max(m_all, j.part_ml[((first + s) * j.rows_max + r) * 2]);
    float l_all = 0.f;
    for (int64_t s = 0; s < count; ++s) {
      const float* ml = j.part_ml + ((first + s) * j.rows_max + r) * 2;
      weight[s] = ml[0] == -INFINITY ? 0.f : std::exp(ml[0] - m_all);
      l_all += weight[s] * ml[1];
    }
    const int64_t t = it.t_begin + r / group, head = it.g * group + r % group;
    float* dst = j.out + (t * j.num_heads + head) * d;
    std::memset(dst, 0, d * sizeof(float));
    for (int64_t s = 0; s < count; ++s)
      axpy(weight[s] / l_all, j.part_o + ((first + s) * j.rows_max + r) * d, dst, d);
  }
}

// Whether the auto path multiplies wide items in AMX tiles in this process: AMX-BF16 granted by
// the OS and the tiles' self-check (amx_attention.h) passed in a forked child.
fd_amx::State attention_tiles_state() {
#if defined(__x86_64__)
  static const fd_amx::State state =
      fd_amx::checked_state(fd_amx::Kind::kBf16, fd_amx_attention::tiles_agree<fd_amx::HardwareTiles>,
                            "fd_paged_attention", "vdpbf16ps");
  return state;
#else
  return fd_amx::kNoTiles;
#endif
}

}  // namespace

// Attention of q [T, h, d] into out (T * h * d floats), the caches' checks included.
void paged_attention_into(const paddle::Tensor& q_in, const paddle::Tensor& k_cache, const paddle::Tensor& v_cache,
                          const paddle::Tensor& query_start, const paddle::Tensor& seq_lens,
                          const paddle::Tensor& block_tables, float scale, int64_t sliding_window,
                          int64_t bf16_path, float* out) {
  PD_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: none)");
  PD_CHECK(bf16_path >= 0 && bf16_path <= 4, "bf16_path must be 0 (the CPU's best), 1 (widen), 2 (vdpbf16ps), "
           "3 (AMX tiles) or 4 (AMX tiles on their software model), got ", bf16_path);
  PD_CHECK(bf16_path != 2 || fd_bf16_attention::cpu_has_dot(),
           "bf16_path 2 needs AVX-512 BF16 (vdpbf16ps), which this CPU does not have");
  PD_CHECK(bf16_path != 3 || fd_amx::amx_permitted(fd_amx::Kind::kBf16),
           "bf16_path 3 needs AMX-BF16 tiles granted by the OS, which this CPU or kernel does not have");
  PD_CHECK(q_in.dtype() == paddle::DataType::FLOAT32 && q_in.shape().size() == 3, "q must be float32 [T, h, d]");
  const int64_t T = q_in.shape()[0], h = q_in.shape()[1], d = q_in.shape()[2];
  PD_CHECK(k_cache.shape().size() == 4, "k_cache must be [num_blocks, block_size, kvh, d]");
  const int64_t kvh = k_cache.shape()[2], block_size = k_cache.shape()[1];
  check_cache(k_cache, "k_cache", kvh, d);
  check_cache(v_cache, "v_cache", kvh, d);
  PD_CHECK(k_cache.dtype() == v_cache.dtype(), "k_cache and v_cache must have one dtype");
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
  PD_CHECK(block_size * max_blocks < (int64_t{1} << 31), "positions must fit in 32 bits");
  const int64_t group = h / kvh;
  const int64_t tokens_per_item = std::max<int64_t>(1, kRowsPerItem / group);
  const bool bf16 = is_bf16(k_cache);
  const bool bf16_dot = bf16 && bf16_path != 1 && fd_bf16_attention::cpu_has_dot();
  using fd_amx_attention::Mode;
  const Mode tiles = !bf16 ? Mode::kOff
                     : bf16_path == 3 ? Mode::kHardware
                     : bf16_path == 4 ? Mode::kModel
                     : bf16_path == 0 && attention_tiles_state() == fd_amx::kTilesInUse ? Mode::kHardware
                                                                                        : Mode::kOff;
  const int64_t threads = fd_kernels::Pool::instance().threads();
  // Decode tokens' items hold several kv heads (decode_heads_per_item) on the paths that take
  // them, when there are enough decode tokens to give every thread kItemsPerThread items anyway.
  int64_t decode_heads = 1;
  if (narrow_per_head_group(bf16, bf16_dot, d)) {
    int64_t decodes = 0;
    for (int64_t b = 0; b < B; ++b) decodes += qs[b + 1] - qs[b] == 1;
    if (decodes >= kItemsPerThread * threads) decode_heads = decode_heads_per_item(group, kvh);
  }
  std::vector<int64_t> token_pos(T);
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qs[b + 1] - qs[b];
    PD_CHECK(q_len >= 0 && lens[b] >= q_len, "sequence ", b, ": ", q_len, " new tokens but seq_len ", lens[b]);
    PD_CHECK((lens[b] + block_size - 1) / block_size <= max_blocks, "sequence ", b, " needs more blocks than its table");
    for (int64_t p = 0; p < (lens[b] + block_size - 1) / block_size; ++p)
      PD_CHECK(tables[b * max_blocks + p] >= 0 && tables[b * max_blocks + p] < num_blocks, "sequence ", b,
               " block table entry ", p, " = ", tables[b * max_blocks + p], " outside the cache's ", num_blocks,
               " blocks");
    for (int64_t i = 0; i < q_len; ++i) token_pos[qs[b] + i] = lens[b] - q_len + i;
    for (int64_t t0 = qs[b]; t0 < qs[b + 1]; t0 += tokens_per_item) {
      const int64_t t1 = std::min(qs[b + 1], t0 + tokens_per_item);
      const int64_t k_lo = sliding_window > 0 ? std::max<int64_t>(0, token_pos[t0] - sliding_window + 1) : 0;
      const int64_t heads = q_len == 1 ? decode_heads : 1;
      for (int64_t g = 0; g < kvh; g += heads)
        items.push_back(Item{b, t0, t1, g, k_lo, token_pos[t1 - 1], -1, std::min(heads, kvh - g)});
    }
  }
  if (items.empty()) return;
  // Too few items for the threads (a few long decodes): split long key ranges into partials.
  const int64_t target = kItemsPerThread * threads;
  struct Split {
    int64_t item, first, count;
  };
  std::vector<Split> splits;
  std::vector<Item> work;
  int64_t partials = 0;
  const int64_t base = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < base; ++i) {
    const Item& it = items[i];
    const int64_t keys = it.k_hi - it.k_lo + 1;
    int64_t count = 1;
    if (threads > 1 && base < target && it.heads == 1) count = std::min((target + base - 1) / base, keys / kMinSplitKeys);
    if (count <= 1) {
      work.push_back(it);
      continue;
    }
    const int64_t per = (keys + count - 1) / count;
    const int64_t span = (per + kKeyTile - 1) / kKeyTile * kKeyTile;
    const int64_t first = partials;
    for (int64_t lo = it.k_lo; lo <= it.k_hi; lo += span) {
      Item part = it;
      part.k_lo = lo, part.k_hi = std::min(it.k_hi, lo + span - 1), part.partial = partials++;
      work.push_back(part);
    }
    splits.push_back(Split{i, first, partials - first});
  }
  // The costliest items first (later query blocks of a causal prompt see more keys), so the
  // last items claimed are short and the threads finish together.
  std::stable_sort(work.begin(), work.end(), [](const Item& a, const Item& b) {
    return (a.t_end - a.t_begin) * (a.k_hi - a.k_lo) > (b.t_end - b.t_begin) * (b.k_hi - b.k_lo);
  });
  const int64_t rows_max = tokens_per_item * group;
  std::vector<float> part_o(partials * rows_max * d), part_ml(partials * rows_max * 2);
  const paddle::Tensor q = q_in.contiguous();
  AttentionJob job{q.data<float>(),
                   bf16 ? nullptr : k_cache.data<float>(),
                   bf16 ? nullptr : v_cache.data<float>(),
                   bf16 ? static_cast<const uint16_t*>(k_cache.data()) : nullptr,
                   bf16 ? static_cast<const uint16_t*>(v_cache.data()) : nullptr,
                   token_pos.data(),
                   tables,
                   max_blocks,
                   block_size,
                   h,
                   kvh,
                   d,
                   sliding_window,
                   group,
                   rows_max,
                   bf16_dot,
                   tiles,
                   scale,
                   out,
                   work.data(),
                   part_o.data(),
                   part_ml.data()};
  fd_kernels::Pool::instance().run(static_cast<int64_t>(work.size()), attend_item, &job);
  for (const Split& s : splits) combine_partials(job, items[s.item], s.first, s.count);
}
std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                           const paddle::Tensor& v_cache, const paddle::Tensor& query_start,
                                           const paddle::Tensor& seq_lens, const paddle::Tensor& block_tables,
                                           float scale, int64_t sliding_window, int64_t bf16_path) {
  PD_CHECK(q.shape().size() == 3, "q must be float32 [T, h, d]");
  auto out = fd_graph::empty(q.shape(), paddle::DataType::FLOAT32);
  fd_graph::run("fd_paged_attention", {&q, &k_cache, &v_cache, &query_start, &seq_lens, &block_tables}, {&out},
                [=]() mutable {
                  paged_attention_into(q, k_cache, v_cache, query_start, seq_lens, block_tables, scale,
                                       sliding_window, bf16_path, out.data<float>());
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
                                               int64_t num_kv_heads, float scale, int64_t sliding_window,
                                               int64_t bf16_path) {
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
                                       sliding_window, bf16_path, out.data<float>());
                });
  return {out};
}

std::vector<std::vector<int64_t>> RopePagedAttentionShape(const std::vector<int64_t>& qkv, const std::vector<int64_t>&,
                                                          const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                          const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                          const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                          const std::vector<int64_t>&, int64_t num_heads,
                                                          int64_t num_kv_heads, float, int64_t, int64_t) {
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
                                                      int64_t, int64_t) {
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
    .Attrs({"scale: float", "sliding_window: int64_t", "bf16_path: int64_t"})
    .SetKernelFn(PD_KERNEL(PagedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(PagedAttentionShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PagedAttentionDtype));

// The tile path's state in this process (model = 0: 0 no AMX-BF16 or the OS refused the tile
// state, 1 the auto path multiplies wide items in tiles, 2 the tiles failed the self-check), or
// the self-check run on the tile model (model = 1: 1 when it passes, else 2).
std::vector<paddle::Tensor> AttentionAmxState(const paddle::Tensor& unused, int64_t model) {
  PD_CHECK(model == 0 || model == 1, "model must be 0 (this process's state) or 1 (the check on the tile model), got ",
           model);
  auto out = paddle::empty({1}, paddle::DataType::INT64, paddle::CPUPlace());
  out.data<int64_t>()[0] =
      model == 0 ? attention_tiles_state() : fd_amx::check_state(fd_amx_attention::tiles_agree<fd_amx::ModelTiles>);
  return {out};
}

PD_BUILD_OP(fd_attention_amx_state)
    .Inputs({"Unused"})
    .Outputs({"State"})
    .Attrs({"model: int64_t"})
    .SetKernelFn(PD_KERNEL(AttentionAmxState));

PD_BUILD_OP(fd_rope_paged_attention)
    .Inputs({"QKV", "Positions", "CosSin", "KCache", "VCache", "Slots", "QueryStart", "SeqLens", "BlockTables"})
    .Outputs({"Out"})
    .Attrs({"num_heads: int64_t", "num_kv_heads: int64_t", "scale: float", "sliding_window: int64_t",
            "bf16_path: int64_t"})
    .SetKernelFn(PD_KERNEL(RopePagedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(RopePagedAttentionShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RopePagedAttentionDtype));
