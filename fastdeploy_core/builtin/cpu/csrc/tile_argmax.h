// Each row's argmax of a GEMM's output computed tile by tile, without the output going through
// memory (fd_bf16_linear_argmax, fd_w8a8_linear_argmax: an LM head's greedy tokens). The rule is
// fd_argmax's (sampling.cc): the first index of the largest value, NaN counted as -inf (a row of
// NaN or -inf only gives 0).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "line_buffer.h"
#include "vector_math.h"

namespace fd_kernels {

// The first largest of one row's values in one tile: its value (NaN as -inf) and column.
struct ColumnBest {
  float value;
  int32_t column;
};

inline ColumnBest first_largest(const float* v, int32_t n) {
  ColumnBest best{-INFINITY, 0};
  for (int32_t c = 0; c < n; ++c)
    if (ordered(v[c]) > best.value) best = {ordered(v[c]), c};
  return best;
}

// first_largest of a tile's 32 columns: the largest value over the lanes, then the first lane
// holding it (with AVX-512 two vectors and a mask; a scalar loop of 32 compares and branches per
// row and tile was ~40% of a 64-row step's head on a Xeon with AMX).
inline ColumnBest first_largest32(const float* v) {
#if defined(__AVX512F__)
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  a = _mm512_mask_mov_ps(ninf, _mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), a);
  b = _mm512_mask_mov_ps(ninf, _mm512_cmp_ps_mask(b, b, _CMP_ORD_Q), b);
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
  const __m512 t = _mm512_set1_ps(top);
  const uint32_t hits = static_cast<uint32_t>(_mm512_cmp_ps_mask(a, t, _CMP_EQ_OQ)) |
                        static_cast<uint32_t>(_mm512_cmp_ps_mask(b, t, _CMP_EQ_OQ)) << 16;
  return {top, static_cast<int32_t>(__builtin_ctz(hits))};
#else
  return first_largest(v, 32);
#endif
}

// Each row's best per tile of one call, tile-major: values[t][r] and columns[t][r] for rows
// padded to a multiple of 16, so a block of rows of one tile writes side by side and the last
// pass compares 16 rows per vector, tile after tile. This thread's storage.
class TileBest {
 public:
  TileBest(int64_t M, int64_t tiles) : rows_((M + 15) / 16 * 16), M_(M), tiles_(tiles) {
    thread_local LineBuffer<float> values;  // 16 rows per vector (line_buffer.h)
    thread_local LineBuffer<int32_t> columns;
    values.resize(static_cast<size_t>(rows_ * tiles));  // rows past M keep whatever they held: never read out
    columns.resize(static_cast<size_t>(rows_ * tiles));
    values_ = values.data();
    columns_ = columns.data();
  }

  // Rows m .. m + rows - 1 of tile t from their 32 outputs (row r at v + r * stride).
  void put(int64_t t, int64_t m, int64_t rows, const float* v, int64_t stride) {
    for (int64_t r = 0; r < rows; ++r) {
      const ColumnBest b = first_largest32(v + r * stride);
      values_[t * rows_ + m + r] = b.value;
      columns_[t * rows_ + m + r] = b.column;
    }
  }

  // out[m] = the column of row m's first largest value over the tiles (each `cols` wide): the
  // first tile holding the largest value (a later tile must be larger to win), then its column.
  void argmax(int64_t cols, int64_t* out) const {
    for (int64_t r0 = 0; r0 < M_; r0 += 16) {
      f32x16 top = f32x16{} - INFINITY;
      i32x16 tile = i32x16{};
      for (int64_t t = 0; t < tiles_; ++t) {
        const f32x16 v = load16(values_ + t * rows_ + r0);
        const i32x16 wins = v > top;
        top = select(wins, v, top);
        tile = select(wins, i32x16{} + static_cast<int32_t>(t), tile);
      }
      for (int64_t r = r0; r < std::min<int64_t>(M_, r0 + 16); ++r)
        out[r] = tile[r - r0] * cols + columns_[tile[r - r0] * rows_ + r];
    }
  }

 private:
  int64_t rows_, M_, tiles_;
  float* values_;
  int32_t* columns_;
};

}  // namespace fd_kernels
