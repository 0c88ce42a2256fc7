// How a many-row GEMM over 32-column tiles is split among the pool's threads and how a tile
// runs its rows through register blocks (fd_bf16_linear's and fd_w8a8_linear's loops).
//
// Work items are (panel of kPanelRows rows, one or two tiles): a prompt's rows go in panels so
// a panel's activations (64 x K values) stay in L2 while its tiles stream past, instead of all
// rows being read again for every tile. Inside an item each tile takes the panel's rows in
// blocks of BLOCK rows and one block of the remainder. Blocks never change a row's sums (one
// chain per output), so the split is free to choose.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <unistd.h>

#include "thread_pool.h"

namespace fd_kernels {

constexpr int64_t kPanelRows = 64;
constexpr int64_t kMaxPanelRows = 512;

// Rows per panel for the AMX loops, whose activations take row_bytes per row: as many as fill
// half of this core's L2 (sysconf's figure; 1 MiB when it has none), a multiple of kPanelRows
// from kPanelRows to kMaxPanelRows. Every panel streams all of the weights past its rows, so
// fewer, larger panels read them fewer times: on a Xeon with AMX (2 MiB L2, 2 threads) a
// 512-token prompt's bf16 linears took 0.19 instead of 0.21-0.22 CPU s with panels of 256-512
// rows instead of 64 (benchmarks/perf_cpu.md).
inline int64_t panel_rows_for(int64_t row_bytes) {
  static const int64_t l2 = [] {
    const long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return size > 0 ? static_cast<int64_t>(size) : int64_t{1} << 20;
  }();
  const int64_t rows = l2 / 2 / std::max<int64_t>(row_bytes, 1) / kPanelRows * kPanelRows;
  return std::min(kMaxPanelRows, std::max(kPanelRows, rows));
}

// run(std::integral_constant<int, R>{}, m) for rows [m_begin, m_end): blocks of BLOCK (<= 8)
// rows, then the remainder as one block.
template <int BLOCK, class Run>
inline void row_blocks(int64_t m_begin, int64_t m_end, Run&& run) {
  static_assert(BLOCK >= 1 && BLOCK <= 8, "a register block has 1 to 8 rows");
  int64_t m = m_begin;
  for (; m + BLOCK <= m_end; m += BLOCK) run(std::integral_constant<int, BLOCK>{}, m);
  switch (m_end - m) {
    case 7: if constexpr (BLOCK > 7) run(std::integral_constant<int, 7>{}, m); break;
    case 6: if constexpr (BLOCK > 6) run(std::integral_constant<int, 6>{}, m); break;
    case 5: if constexpr (BLOCK > 5) run(std::integral_constant<int, 5>{}, m); break;
    case 4: if constexpr (BLOCK > 4) run(std::integral_constant<int, 4>{}, m); break;
    case 3: if constexpr (BLOCK > 3) run(std::integral_constant<int, 3>{}, m); break;
    case 2: if constexpr (BLOCK > 2) run(std::integral_constant<int, 2>{}, m); break;
    case 1: if constexpr (BLOCK > 1) run(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

// rows(m_begin, m_end) for the M rows in chunks of CHUNK, the chunks spread over the pool: the
// per-row preparation of a GEMM's activations (rounding, quantizing) beside each other.
template <int64_t CHUNK, class Rows>
inline void run_row_chunks(int64_t M, const Rows& rows) {
  struct Job {
    const Rows* rows;
    int64_t M;
  } job{&rows, M};
  Pool::instance().run(
      (M + CHUNK - 1) / CHUNK,
      [](void* ctx, int64_t c) {
        const Job& j = *static_cast<const Job*>(ctx);
        (*j.rows)(c * CHUNK, std::min(j.M, (c + 1) * CHUNK));
      },
      &job);
}

// tile_rows(t, m_begin, m_end) for every tile t < tiles and every panel of the M rows, on the pool.
template <class TileRows>
inline void run_row_panels(int64_t M, int64_t tiles, const TileRows& tile_rows) {
  struct Split {
    const TileRows* tile_rows;
    int64_t M, tiles, per_chunk, tile_chunks;
  };
  // Two tiles per item (the panel's rows read once for both) unless that leaves the threads
  // unevenly loaded: 18 tiles of one panel as 9 items make one thread run 5 while the other
  // runs 4 (10% of a [64, 576] x [576, 576] step lost), as 18 items 9 and 9.
  const int64_t panels = std::max<int64_t>(1, (M + kPanelRows - 1) / kPanelRows);
  const int64_t threads = Pool::instance().threads();
  const int64_t paired = (tiles + 1) / 2 * panels;
  const int64_t per_chunk = tiles >= 16 && (paired % threads == 0 || paired >= 8 * threads) ? 2 : 1;
  Split s{&tile_rows, M, tiles, per_chunk, (tiles + per_chunk - 1) / per_chunk};
  const int64_t chunks = s.tile_chunks * panels;
  Pool::instance().run(
      chunks,
      [](void* ctx, int64_t c) {
        const Split& j = *static_cast<const Split*>(ctx);
        const int64_t panel = c / j.tile_chunks, tc = c % j.tile_chunks;
        const int64_t m_begin = panel * kPanelRows, m_end = std::min(j.M, m_begin + kPanelRows);
        for (int64_t t = tc * j.per_chunk; t < std::min(j.tiles, (tc + 1) * j.per_chunk); ++t)
          (*j.tile_rows)(t, m_begin, m_end);
      },
      &s);
}

// group_rows(t_begin, t_end, m_begin, m_end) for the tiles in groups and the M rows in panels of
// panel_rows, on the pool. Groups of up to kMaxGroupTiles tiles whose weights a panel's row
// blocks reuse from L2 (fd_amx::group_blocks); their count the smallest that divides
// the tiles evenly, gives every thread the same number of items and at least two items per
// thread (one tile per item when none does).
constexpr int64_t kMaxGroupTiles = 16;

template <class GroupRows>
inline void run_tile_groups(int64_t M, int64_t tiles, int64_t panel_rows, const GroupRows& group_rows) {
  struct Split {
    const GroupRows* group_rows;
    int64_t M, tiles, panel_rows, groups, per_group;
  };
  const int64_t panels = std::max<int64_t>(1, (M + panel_rows - 1) / panel_rows);
  const int64_t threads = Pool::instance().threads();
  int64_t groups = tiles;
  for (int64_t g = std::max<int64_t>(1, (tiles + kMaxGroupTiles - 1) / kMaxGroupTiles); g <= tiles; ++g)
    if (tiles % g == 0 && (panels * g) % threads == 0 && panels * g >= 2 * threads) {
      groups = g;
      break;
    }
  Split s{&group_rows, M, tiles, panel_rows, groups, tiles / groups};
  Pool::instance().run(
      panels * groups,
      [](void* ctx, int64_t c) {
        const Split& j = *static_cast<const Split*>(ctx);
        const int64_t panel = c / j.groups, g = c % j.groups;
        const int64_t m_begin = panel * j.panel_rows, m_end = std::min(j.M, m_begin + j.panel_rows);
        (*j.group_rows)(g * j.per_group, std::min(j.tiles, (g + 1) * j.per_group), m_begin, m_end);
      },
      &s);
}

}  // namespace fd_kernels
