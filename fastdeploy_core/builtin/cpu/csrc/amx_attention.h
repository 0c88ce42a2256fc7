// AMX tiles for the attention over a bfloat16 KV cache (paged_attention.cc): the scores and the
// weighted values of its wide items (prompt chunks: 12 or more query rows of one kv head) as
// tile products, for CPUs with AMX-BF16 (Intel Sapphire Rapids and later).
//
// The formula is bf16_attention.h's (rounded queries, rounded softmax weights, float32 sums);
// tiles sum in their own order (per tdpbf16ps: 16 k pairs in two chains, then added to C), so
// this path agrees with the dot and widen paths to float32 rounding, not bit for bit (with the
// tile model it agrees bit for bit, on an AMX CPU).
//
// Both products are amx_tiles.h's tile_block, with the operands laid out as it reads them:
//   scores   st[j][r] = key_j . q_r: A = the tile's key rows gathered from the cache
//            ([keys rounded up to 32, d] bfloat16, d / 2 pairs per row), B = the queries as k
//            pairs, qp[i][r] (bf16_attention.h's pack_query_pairs over rows rounded up to 32:
//            the B tiles read 32 columns). C is st's [32 keys x 32 rows] block.
//   values   o[r][c] = o[r][c] * alpha[r] + sum_p w[r][p] . v[p][c]: A = the weights as key pairs
//            per row, wa[r][p] (pairs rounded up to 16, zero past the tile's keys), B = the value
//            rows as key pairs, vp[p][c] (pack_value_pairs, zero pair rows past the keys). C is
//            a [32 rows x 32 columns] block of the sums, added to the rescaled output after.
// Head sizes a multiple of 32 (whole tiles of k pairs, whole 32-column blocks): 32, 64, 128, ...
//
// The hardware path ran on an Intel Xeon with AMX (2026-12-06); on CPUs without AMX the tests run
// the loop on amx_tiles.h's software model of the instructions (Mode::kModel).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "amx_tiles.h"
#include "bf16_attention.h"

namespace fd_amx_attention {

// Which tiles a call multiplies on: none, the instructions, or the software model.
enum class Mode : int { kOff = 0, kHardware = 1, kModel = 2 };

// Whether the tile path takes head size d.
inline bool takes(int64_t d) { return d > 0 && d % 32 == 0; }

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Rows of the query pairs (qp's stride): the B tiles of the scores read 32 columns at a time.
inline int64_t query_columns(int64_t mp) { return round_up(mp, 32); }

// Pairs per row of the weights (wa's stride): the tile's key pairs rounded up to whole tiles.
inline int64_t weight_pairs(int64_t nk) { return round_up((nk + 1) / 2, fd_amx::kTileGroups); }

// This thread's tiles configured for a scope (an item) and released after; nothing for kOff.
class ItemTiles {
 public:
  explicit ItemTiles(Mode mode) : mode_(mode) {
    static const fd_amx::TileConfig cfg;
#if defined(__x86_64__)
    if (mode_ == Mode::kHardware) fd_amx::HardwareTiles::configure(cfg);
#endif
    if (mode_ == Mode::kModel) fd_amx::ModelTiles::configure(cfg);
  }
  ~ItemTiles() {
#if defined(__x86_64__)
    if (mode_ == Mode::kHardware) fd_amx::HardwareTiles::release();
#endif
    if (mode_ == Mode::kModel) fd_amx::ModelTiles::release();
  }
  ItemTiles(const ItemTiles&) = delete;
  ItemTiles& operator=(const ItemTiles&) = delete;

 private:
  Mode mode_;
};

// The tile's key rows (k16 + off[j], d bfloat16 each) gathered into kb [round_up(nk, 32), d],
// zero past nk.
inline void gather_keys(const uint16_t* k16, const int64_t* off, int64_t nk, int64_t d, uint16_t* kb) {
  for (int64_t j = 0; j < nk; ++j) std::memcpy(kb + j * d, k16 + off[j], d * sizeof(uint16_t));
  std::memset(kb + nk * d, 0, (round_up(nk, 32) - nk) * d * sizeof(uint16_t));
}

// The softmax weights of a tile's keys for rows rv .. rv + 15, straight into wa: p = exp(st[j *
// mp + rv + i] - m_use) for keys j < nk (the other paths' exponentials, the same values), added
// to the returned sum in two chains, the even keys' and the odd keys' (each in key order; one
// chain of dependent additions was ~10% of a prompt's attention on a Xeon with AMX), which are
// added last; rounded to bfloat16 (round_bits16) as key
// pairs per row, the A tiles of weighted_values: wa[r * ps + p] = bf16(p_2p) | bf16(p_2p+1) << 16
// for rows r < m (the rows after them, which the tiles read up to round_up(m, 32), are the
// caller's zeros), zero for pairs past the keys. The weights are never stored as float32, and
// 16 pairs of the 16 rows are transposed in registers, not stored one value at a time.
inline fd_kernels::f32x16 exp_weight_rows(const float* st, int64_t nk, int64_t mp, int64_t rv, int64_t m,
                                          fd_kernels::f32x16 m_use, int64_t ps, uint32_t* wa) {
  using fd_kernels::f32x16;
  using fd_kernels::u32x16;
  f32x16 sum_even{}, sum_odd{};
  auto rounded = [](f32x16 e) {  // bf16_attention.h's round_bits16 on a register
    const u32x16 u = fd_kernels::bitcast<u32x16>(e);
    return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  };
  const int64_t rows = std::min<int64_t>(16, m - rv);
  for (int64_t p0 = 0; p0 < ps; p0 += 16) {
    u32x16 pair[16];
    for (int q = 0; q < 16; ++q) {
      const int64_t j = 2 * (p0 + q);
      u32x16 lo{}, hi{};
      if (j < nk) {
        const f32x16 e = fd_kernels::exp16(fd_kernels::load<f32x16>(st + j * mp + rv) - m_use);
        sum_even += e;
        lo = rounded(e) >> 16;
      }
      if (j + 1 < nk) {
        const f32x16 e = fd_kernels::exp16(fd_kernels::load<f32x16>(st + (j + 1) * mp + rv) - m_use);
        sum_odd += e;
        hi = rounded(e);
      }
      pair[q] = lo | hi;
    }
    fd_kernels::transpose16(pair);
    for (int64_t i = 0; i < rows; ++i) fd_kernels::store(wa + (rv + i) * ps + p0, pair[i]);
  }
  return sum_even + sum_odd;
}

// The tile's value rows as key pairs (vp [ps, d], pack_value_pairs), zero pair rows past nk.
inline void pack_value_rows(const uint16_t* v16, const int64_t* off, int64_t nk, int64_t d, int64_t ps, uint32_t* vp) {
  fd_bf16_attention::pack_value_pairs(v16, off, nk, d, vp);
  const int64_t pairs = (nk + 1) / 2;
  std::memset(vp + pairs * d, 0, (ps - pairs) * d * sizeof(uint32_t));
}

// Where the scores' A tiles read a tile's keys: key j0 + i (j0 a multiple of 32, i < 32) at
// base + first(j0) + i * stride bfloat16 values. In place in the cache when each 32 keys of the
// tile are consecutive rows of one cache block (block_size and the tile's first key multiples of
// 32): first(j0) = off[j0], stride = the cache's row (kv heads x d); the rows a tile reads past the
// tile's last key are then the block's next rows, whose scores are never read. Else gathered by
// gather_keys: first(j0) = j0 * d, stride = d.
struct KeyRows {
  const uint16_t* base;
  const int64_t* off;  // nullptr: gathered
  int64_t stride;
  const uint16_t* first(int64_t j0) const { return base + (off != nullptr ? off[j0] : j0 * stride); }
};

// st[j * mp + r] = key_j . q_r for keys j < nk (keys: KeyRows) and rows r < mp (qp: the query
// pairs, mq = query_columns(mp) per pair row), st's rows 64-byte aligned (mp a multiple of 16)
// with room for nk rounded up to 32 rows (a block of 32 columns is stored straight from the
// tiles, rows past nk included; a last block of fewer columns through a buffer). The caller
// holds an ItemTiles.
template <class Tiles>
void scores(const KeyRows& keys, int64_t nk, int64_t d, const uint32_t* qp, int64_t mq, int64_t mp, float* st) {
  alignas(64) uint32_t out[fd_amx::kBlockRows][fd_amx::kTileCols];
  fd_amx::TileOperands op{nullptr, keys.stride / 2, nullptr, d / 2, nullptr, mq * 4};
  for (int64_t r0 = 0; r0 < mp; r0 += fd_amx::kTileCols) {
    const int64_t cols = std::min<int64_t>(fd_amx::kTileCols, mp - r0);
    op.w = reinterpret_cast<const uint8_t*>(qp + r0);
    for (int64_t j0 = 0; j0 < nk; j0 += fd_amx::kBlockRows) {
      const int64_t rows = std::min<int64_t>(fd_amx::kBlockRows, nk - j0);
      op.a = reinterpret_cast<const uint32_t*>(keys.first(j0));
      if (cols == fd_amx::kTileCols) {
        fd_amx::tile_block_rows<Tiles>(fd_amx::Kind::kBf16, op, rows, reinterpret_cast<uint8_t*>(st + j0 * mp + r0),
                                       mp * 4, false);
        continue;
      }
      fd_amx::tile_block_rows<Tiles>(fd_amx::Kind::kBf16, op, rows, reinterpret_cast<uint8_t*>(&out[0][0]),
                                     fd_amx::kTileCols * 4, false);
      for (int64_t i = 0; i < rows; ++i) std::memcpy(st + (j0 + i) * mp + r0, out[i], cols * sizeof(float));
    }
  }
}

// o[r * d + c] = o[r * d + c] * alpha[r] + sum_p wa[r][p] . vp[p][c] for rows r < m (wa: ps pairs
// per row, rows up to round_up(m, 32) readable; vp: ps pair rows of d). The caller holds an
// ItemTiles.
template <class Tiles>
void weighted_values(const uint32_t* wa, int64_t ps, int64_t m, const uint32_t* vp, int64_t d, const float* alpha,
                     float* o) {
  alignas(64) uint32_t out[fd_amx::kBlockRows][fd_amx::kTileCols];
  fd_amx::TileOperands op{nullptr, ps, nullptr, ps, nullptr, d * 4};
  for (int64_t r0 = 0; r0 < m; r0 += fd_amx::kBlockRows) {
    const int64_t rows = std::min<int64_t>(fd_amx::kBlockRows, m - r0);
    op.a = wa + r0 * ps;
    for (int64_t c0 = 0; c0 < d; c0 += fd_amx::kTileCols) {
      op.w = reinterpret_cast<const uint8_t*>(vp + c0);
      fd_amx::tile_block_rows<Tiles>(fd_amx::Kind::kBf16, op, rows, reinterpret_cast<uint8_t*>(&out[0][0]),
                                     fd_amx::kTileCols * 4, false);
      for (int64_t i = 0; i < rows; ++i) {
        float* orow = o + (r0 + i) * d + c0;
        const fd_kernels::f32x16 a = fd_kernels::f32x16{} + alpha[r0 + i];
        for (int64_t c = 0; c < fd_amx::kTileCols; c += 16) {
          const fd_kernels::f32x16 s = fd_kernels::bitcast<fd_kernels::f32x16>(fd_kernels::load<fd_kernels::u32x16>(&out[i][c]));
          fd_kernels::store16(orow + c, fd_kernels::load16(orow + c) * a + s);
        }
      }
    }
  }
}

inline void scores(Mode mode, const KeyRows& keys, int64_t nk, int64_t d, const uint32_t* qp, int64_t mq, int64_t mp,
                   float* st) {
#if defined(__x86_64__)
  if (mode == Mode::kHardware) return scores<fd_amx::HardwareTiles>(keys, nk, d, qp, mq, mp, st);
#endif
  scores<fd_amx::ModelTiles>(keys, nk, d, qp, mq, mp, st);
}

inline void weighted_values(Mode mode, const uint32_t* wa, int64_t ps, int64_t m, const uint32_t* vp, int64_t d,
                            const float* alpha, float* o) {
#if defined(__x86_64__)
  if (mode == Mode::kHardware) return weighted_values<fd_amx::HardwareTiles>(wa, ps, m, vp, d, alpha, o);
#endif
  weighted_values<fd_amx::ModelTiles>(wa, ps, m, vp, d, alpha, o);
}

// The self-check: both products on Tiles against float64 sums of the same bfloat16 operands, on
// a tile of 40 keys (a block of 32 and one of 8, read in place and gathered; 20 pairs in a tile of 16 + 4), 48 query rows
// (columns 32-47 of a second block), 20 output rows, head size 64. Each result within 1e-5 of
// the sum of its products' magnitudes.
template <class Tiles>
bool tiles_agree() {
  constexpr int64_t nk = 40, mp = 48, m = 20, d = 64;
  const int64_t mq = query_columns(mp), ps = weight_pairs(nk);
  uint32_t seed = 12345u;
  auto next = [&seed]() {  // bfloat16 bits of a value in about [-2, 2]
    seed = seed * 1664525u + 1013904223u;
    const float f = (static_cast<float>(seed >> 8) / 16777216.f) * 4.f - 2.f;
    return static_cast<uint16_t>(fd_bf16_attention::round_bits(f) >> 16);
  };
  auto widen = [](uint32_t half) {
    const uint32_t bits = half << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return static_cast<double>(f);
  };
  // The keys as a cache block of 64 rows of 3 kv heads (this check's head the second), read in
  // place in order, and gathered out of order.
  constexpr int64_t row = 3 * d, block = 64;
  fd_amx::TileBuffer<uint16_t> cache(block * row), kb(round_up(nk, 32) * d);
  std::vector<int64_t> in_order(nk), reversed(nk);
  for (auto& x : cache) x = next();
  for (int64_t j = 0; j < nk; ++j) in_order[j] = j * row + d, reversed[j] = (nk - 1 - j) * row + d;
  gather_keys(cache.data(), reversed.data(), nk, d, kb.data());
  fd_amx::TileBuffer<uint32_t> qp(d / 2 * mq, 0u);
  for (int64_t i = 0; i < d / 2; ++i)
    for (int64_t r = 0; r < mp; ++r) qp[i * mq + r] = next() | static_cast<uint32_t>(next()) << 16;
  for (const bool in_place : {true, false}) {
    const std::vector<int64_t>& off = in_place ? in_order : reversed;
    const KeyRows keys = in_place ? KeyRows{cache.data(), off.data(), row} : KeyRows{kb.data(), nullptr, d};
    fd_amx::TileBuffer<float> st(round_up(nk, 32) * mp, 0.f);
    {
      fd_amx::TileScope<Tiles> tiles;
      scores<Tiles>(keys, nk, d, qp.data(), mq, mp, st.data());
    }
    for (int64_t j = 0; j < nk; ++j)
      for (int64_t r = 0; r < mp; ++r) {
        double want = 0, mag = 0;
        for (int64_t i = 0; i < d / 2; ++i)
          for (int e = 0; e < 2; ++e) {
            const double p = widen(cache[off[j] + 2 * i + e]) * widen((qp[i * mq + r] >> (16 * e)) & 0xffffu);
            want += p, mag += std::fabs(p);
          }
        if (!(std::fabs(st[j * mp + r] - want) <= 1e-5 * mag)) return false;
      }
  }
  // Weighted values: the weights exp(s) of scores s in about [-2, 2], packed by exp_weight_rows,
  // and the same exponentials (the rows' vectors' lanes) for the sums below.
  fd_amx::TileBuffer<uint32_t> wa(round_up(m, 32) * ps, 0u), vp(ps * d, 0u);
  std::vector<float> sc(nk * mp), w(nk * mp);
  for (auto& x : sc) x = static_cast<float>(widen(next()));
  for (int64_t rv = 0; rv < m; rv += 16) {
    exp_weight_rows(sc.data(), nk, mp, rv, m, fd_kernels::f32x16{}, ps, wa.data());
    for (int64_t j = 0; j < nk; ++j) {
      const fd_kernels::f32x16 e = fd_kernels::exp16(fd_kernels::load<fd_kernels::f32x16>(sc.data() + j * mp + rv));
      for (int i = 0; i < 16; ++i) w[j * mp + rv + i] = e[i];
    }
  }
  std::vector<uint16_t> values(nk * d);
  std::vector<int64_t> off(nk);
  for (int64_t j = 0; j < nk; ++j) off[j] = (nk - 1 - j) * d;  // rows gathered out of order
  for (auto& x : values) x = next();
  pack_value_rows(values.data(), off.data(), nk, d, ps, vp.data());
  std::vector<float> o(m * d), alpha(m);
  for (int64_t r = 0; r < m; ++r) alpha[r] = r % 2 ? 0.5f : 1.f;
  for (auto& x : o) x = static_cast<float>(widen(next()));
  const std::vector<float> o0 = o;
  {
    fd_amx::TileScope<Tiles> tiles;
    weighted_values<Tiles>(wa.data(), ps, m, vp.data(), d, alpha.data(), o.data());
  }
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < d; ++c) {
      double want = static_cast<double>(o0[r * d + c]) * alpha[r], mag = std::fabs(want);
      for (int64_t j = 0; j < nk; ++j) {
        const double p = widen(fd_bf16_attention::round_bits(w[j * mp + r]) >> 16) * widen(values[off[j] + c]);
        want += p, mag += std::fabs(p);
      }
      if (!(std::fabs(o[r * d + c] - want) <= 1e-5 * mag)) return false;
    }
  return true;
}

}  // namespace fd_amx_attention
