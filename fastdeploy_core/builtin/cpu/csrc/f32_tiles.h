// fd_f32_linear's 32-column tiles for other kernels that must reproduce its float32 results bit
// for bit (greedy_head.cc recomputes a few tiles of the LM head instead of all of them).
//
// fd_f32_linear computes y[m, n] as a float32 sum over k in one of two orders, chosen by the row
// tile row m falls in: one accumulation chain (k = 0, 1, ..., K - 1), or, in tiles of 1-2 rows,
// two chains (even k and odd k, added at the end). Rows never mix, so a row's results are the
// same whichever other rows share its tile, as long as the chain choice is the same. Both
// functions are defined in weight_only_gemm.cc next to the loop they mirror.
#pragma once

#include <cstdint>

namespace fd_kernels {

// Output columns per tile of the packed layout [N / 32, K, 32].
constexpr int64_t kTileColumns = 32;

// Whether fd_f32_linear over M rows computes row m with two accumulation chains.
bool f32_linear_two_chains(int64_t m, int64_t M);

// y[r, 0..32) = x[r] @ W[:, 32 t .. 32 t + 32) for rows r of x ([rows, K], contiguous), W the
// packed float32 weight [N / 32, K, 32], with fd_f32_linear's loop and the given chain choice
// (two_chains needs rows <= 2). Runs on the calling thread.
void f32_linear_tile(const float* x, int64_t rows, int64_t K, const float* w_packed, int64_t t, bool two_chains,
                     float* y);

// y[m, 32 t .. 32 t + 32) (row stride N) for the M rows of x ([M, K], contiguous) times one
// tile's float32 weights w_tile ([K, 32], contiguous): fd_f32_linear's loop for many rows, in
// the register file's geometry, with one accumulation chain (k in order) for every row, small
// row blocks included. Runs on the calling thread (f32_linear_tile's one-chain rows, and the
// kernels that widen a quantized or bfloat16 tile into w_tile once and run their rows over it).
void f32_tile_rows_one_chain(const float* x, int64_t M, int64_t K, const float* w_tile, int64_t t, int64_t N,
                             float* y);

// The calling thread's buffer for one widened tile (K x 32 floats), on a 64-byte boundary: each
// of the loop's weight loads is then one cache line (a std::vector's 16-byte alignment split
// half of them across two, ~1.3x the loop's time at 64 rows on an Ice Lake Xeon). Reused from
// call to call; grows, never shrinks.
float* tile_buffer(int64_t K);

}  // namespace fd_kernels
