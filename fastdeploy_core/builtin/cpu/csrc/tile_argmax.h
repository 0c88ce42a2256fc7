// Each row's argmax of a GEMM's output computed tile by tile, without the output going through
// memory (fd_bf16_linear_argmax, fd_w8a8_linear_argmax: an LM head's greedy tokens). The rule is
// fd_argmax's (sampling.cc): the first index of the largest value, NaN counted as -inf (a row of
// NaN or -inf only gives 0).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "row_panels.h"
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

// This thread's [M, tiles] table of each row's best per tile, which the tiles' items fill.
inline ColumnBest* tile_best_table(int64_t M, int64_t tiles) {
  thread_local std::vector<ColumnBest> table;
  table.resize(static_cast<size_t>(M * tiles));
  return table.data();
}

// out[m] = the column of row m's first largest value over its tiles (best: tile_best_table, each
// tile `cols` columns wide): the first tile holding the largest value, then its first column.
inline void argmax_over_tiles(const ColumnBest* best, int64_t M, int64_t tiles, int64_t cols, int64_t* out) {
  run_row_chunks<16>(M, [=](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const ColumnBest* row = best + m * tiles;
      int64_t top = 0;
      for (int64_t t = 1; t < tiles; ++t)
        if (row[t].value > row[top].value) top = t;
      out[m] = top * cols + row[top].column;
    }
  });
}

}  // namespace fd_kernels
