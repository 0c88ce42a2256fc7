// AMX tiles for the linear layers' many-row steps and the attention of prompt chunks
// (amx_attention.h) (Intel Sapphire Rapids and later): whether this process may use them, the
// tile operations, and one 32-column tile of a GEMM on them.
//
// The weights' packed layouts are already what a B tile reads: fd_bf16_linear's [N / 32, K / 2,
// 32, 2] and fd_w8a8_linear's [N / 32, K / 4, 32, 4] both store, per 32-bit group of k (a pair
// of bfloat16, a quad of int8) 32 columns x 4 bytes; 16 columns of 16 consecutive groups are a
// B tile of 16 rows x 64 bytes, 128 bytes apart. A tile is 16 rows of x as 16 groups each.
// Tiles: C00..C11 = tmm0..3 (a 32 x 32 block of sums), A0 / A1 = tmm4 / 5 (rows 0-15 / 16-31),
// B0 / B1 = tmm6 / 7 (columns 0-15 / 16-31), every tile 16 rows x 64 bytes.
//
// Two implementations of the tile operations run the same loop (group_blocks):
//   HardwareTiles: the instructions (tileloadd, tdpbf16ps, tdpbssd, ...), emitted as inline
//     assembly, so the library needs no -mamx flags and still builds for CPUs without AMX; only
//     called after amx_permitted() said yes.
//   ModelTiles: a software model of the same instructions (rows, bytes, per-row sums; the
//     bfloat16 sums in the order the SDM's Operation section gives, with its DAZ / FTZ), which
//     runs on any CPU: the tests check the loop's addressing, padding and remainders through it
//     on machines without AMX. On an Intel Xeon with AMX (2026-12-06) the instructions gave the
//     model's bits exactly, bfloat16 and int8; the tests compare the two bit for bit.
//
// Permission: Linux hands out the tile data state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once per process, for all its threads; without it
// the first tile instruction is a SIGILL. amx_permitted() asks once and says no when the CPU
// lacks AMX-TILE (+ AMX-BF16 / AMX-INT8) or the kernel refuses: Linux < 5.16, or a thread of the
// process with an alternate signal stack too small for the tile state (Linux checks them all).
// The kernels then keep their vector paths; the tests on an AMX CPU fail on such a refusal.
//
// Executed on an Intel Xeon with AMX-BF16 / AMX-INT8 (2026-12-06, 2 vCPUs): the tests, and the
// benchmarks in benchmarks/perf_cpu.md. Earlier machines of this project (AMD EPYC Zen 4) have no
// AMX and run only the model.
#pragma once

#include <cpuid.h>
#include <errno.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <vector>

#include "line_buffer.h"
#include "row_panels.h"

namespace fd_amx {

constexpr int64_t kTileRows = 16;      // rows of a tile
constexpr int64_t kTileGroups = 16;    // 32-bit groups (64 bytes) per tile row
constexpr int64_t kBlockRows = 32;     // rows of x per block: A0 and A1
constexpr int64_t kTileCols = 32;      // output columns per weight tile: B0 and B1
constexpr int64_t kGroupBytes = kTileCols * 4;  // one group of k of one weight tile: 128 bytes

enum class Kind { kBf16, kInt8 };

// Buffers that tiles load from: 64-byte aligned (line_buffer.h), so that each 64-byte row of a
// tile is one cache line.
template <class T>
using TileBuffer = fd_kernels::LineBuffer<T>;

// Whether this process may run tile instructions of `kind` (asked once per kind).
inline bool amx_permitted(Kind kind) {
#if defined(__x86_64__)
  static const bool tiles = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1u)) return false;  // AMX-TILE
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  static const bool bf16 = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1u);  // AMX-BF16
  }();
  static const bool int8 = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 25) & 1u);  // AMX-INT8
  }();
  return tiles && (kind == Kind::kBf16 ? bf16 : int8);
#else
  (void)kind;
  return false;
#endif
}

// Whether check() returns true when run in a forked child of this process (one thread, the
// tile permission inherited): a kernel's self-check of its tile path runs there, so that a fault
// in it (SIGILL, SIGSEGV: a hypervisor that lists AMX but does not pass the state through, say) is
// a "no" and the kernels keep their vector paths, instead of killing the server.
template <class Check>
inline bool passes_in_child(const Check& check) {
  const pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) {
    // A fault ends the child quietly: default actions (not the parent's handlers, such as
    // Python's faulthandler printing its stacks) and no core file.
    for (int sig : {SIGILL, SIGSEGV, SIGBUS, SIGFPE}) signal(sig, SIG_DFL);
    const struct rlimit no_core = {0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    _exit(check() ? 0 : 1);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// Whether a kernel's auto path takes tiles of `kind` in this process.
enum State : int64_t { kNoTiles = 0, kTilesInUse = 1, kTilesFailedCheck = 2 };

// What check() run in a forked child says: tiles in use (it passed) or failed. The kernels'
// state ops also report it for their self-check run on the tile model (the check's own tests).
template <class Check>
inline State check_state(const Check& check) {
  return passes_in_child(check) ? kTilesInUse : kTilesFailedCheck;
}

// The state for a kernel whose tile path is checked by check() (true: it computes what the
// kernel's other path does): no tiles without the OS's permission; else check() in a forked
// child, and on a failure a message naming the kernel and the path it keeps.
template <class Check>
inline State checked_state(Kind kind, const Check& check, const char* kernel, const char* fallback) {
  if (!amx_permitted(kind)) return kNoTiles;
  if (check_state(check) == kTilesInUse) return kTilesInUse;
  std::fprintf(stderr, "%s: the AMX tile path failed its self-check (a disagreement or a fault); %s is used "
                       "instead\n", kernel, fallback);
  return kTilesFailedCheck;
}

// The tile configuration (palette 1): 8 tiles of 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = static_cast<uint16_t>(kTileGroups * 4);
      rows[t] = static_cast<uint8_t>(kTileRows);
    }
  }
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

#if defined(__x86_64__)
// The instructions. Tile numbers are literals in the assembly, so each operation is a switch
// over the few tiles the loop uses (folded away: the loop passes constants).
struct HardwareTiles {
  static void configure(const TileConfig& cfg) { asm volatile("ldtilecfg %0" ::"m"(cfg)); }
  static void release() { asm volatile("tilerelease" ::); }
  static void zero(int t) {
    switch (t) {
      case 0: asm volatile("tilezero %%tmm0" ::); break;
      case 1: asm volatile("tilezero %%tmm1" ::); break;
      case 2: asm volatile("tilezero %%tmm2" ::); break;
      default: asm volatile("tilezero %%tmm3" ::); break;
    }
  }
  // The "memory" clobber keeps stores to what a tile reads (padding buffers) before the load.
  static void load(int t, const void* base, int64_t stride) {
    switch (t) {
      case 4: asm volatile("tileloadd (%0,%1,1), %%tmm4" ::"r"(base), "r"(stride) : "memory"); break;
      case 5: asm volatile("tileloadd (%0,%1,1), %%tmm5" ::"r"(base), "r"(stride) : "memory"); break;
      case 6: asm volatile("tileloadd (%0,%1,1), %%tmm6" ::"r"(base), "r"(stride) : "memory"); break;
      default: asm volatile("tileloadd (%0,%1,1), %%tmm7" ::"r"(base), "r"(stride) : "memory"); break;
    }
  }
  static void store(int t, void* base, int64_t stride) {
    switch (t) {
      case 0: asm volatile("tilestored %%tmm0, (%0,%1,1)" ::"r"(base), "r"(stride) : "memory"); break;
      case 1: asm volatile("tilestored %%tmm1, (%0,%1,1)" ::"r"(base), "r"(stride) : "memory"); break;
      case 2: asm volatile("tilestored %%tmm2, (%0,%1,1)" ::"r"(base), "r"(stride) : "memory"); break;
      default: asm volatile("tilestored %%tmm3, (%0,%1,1)" ::"r"(base), "r"(stride) : "memory"); break;
    }
  }
  // C(c) += A(a) B(b) for the loop's four (c, a, b): (0, 4, 6), (1, 4, 7), (2, 5, 6), (3, 5, 7).
  // AT&T order: B, A, C.
  static void dot(Kind kind, int c) {
    if (kind == Kind::kBf16) {
      switch (c) {
        case 0: asm volatile("tdpbf16ps %%tmm6, %%tmm4, %%tmm0" ::); break;
        case 1: asm volatile("tdpbf16ps %%tmm7, %%tmm4, %%tmm1" ::); break;
        case 2: asm volatile("tdpbf16ps %%tmm6, %%tmm5, %%tmm2" ::); break;
        default: asm volatile("tdpbf16ps %%tmm7, %%tmm5, %%tmm3" ::); break;
      }
    } else {
      switch (c) {
        case 0: asm volatile("tdpbssd %%tmm6, %%tmm4, %%tmm0" ::); break;
        case 1: asm volatile("tdpbssd %%tmm7, %%tmm4, %%tmm1" ::); break;
        case 2: asm volatile("tdpbssd %%tmm6, %%tmm5, %%tmm2" ::); break;
        default: asm volatile("tdpbssd %%tmm7, %%tmm5, %%tmm3" ::); break;
      }
    }
  }
};
#endif

// The software model: this thread's 8 tiles of 16 rows x 64 bytes.
struct ModelTiles {
  struct State {
    alignas(64) uint8_t tile[8][kTileRows][kTileGroups * 4];
    bool configured = false;
  };
  static State& state() {
    thread_local State s;
    return s;
  }
  static void configure(const TileConfig&) { state().configured = true; }
  static void release() { state().configured = false; }
  static uint8_t* row(int t, int64_t r) {
    if (!state().configured) __builtin_trap();  // a tile instruction before ldtilecfg faults
    return state().tile[t][r];
  }
  static void zero(int t) {
    for (int64_t r = 0; r < kTileRows; ++r) std::memset(row(t, r), 0, kTileGroups * 4);
  }
  static void load(int t, const void* base, int64_t stride) {
    for (int64_t r = 0; r < kTileRows; ++r)
      std::memcpy(row(t, r), static_cast<const uint8_t*>(base) + r * stride, kTileGroups * 4);
  }
  static void store(int t, void* base, int64_t stride) {
    for (int64_t r = 0; r < kTileRows; ++r)
      std::memcpy(static_cast<uint8_t*>(base) + r * stride, row(t, r), kTileGroups * 4);
  }
  static float bf16_daz(uint16_t h) {
    const uint32_t bits = (h & 0x7F80u) == 0 ? (h & 0x8000u) << 16 : static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  static float ftz(float f) { return std::fabs(f) < 1.17549435e-38f ? std::copysign(0.f, f) : f; }
  static void dot(Kind kind, int c) {
    const int a = 4 + c / 2, b = 6 + c % 2;
    for (int64_t m = 0; m < kTileRows; ++m) {
      uint8_t* cr = row(c, m);
      const uint8_t* ar = row(a, m);
      for (int64_t n = 0; n < kTileGroups; ++n) {
        if (kind == Kind::kInt8) {
          int32_t acc;
          std::memcpy(&acc, cr + 4 * n, 4);
          uint32_t sum = static_cast<uint32_t>(acc);  // wraps as the instruction does
          for (int64_t k = 0; k < kTileGroups; ++k)
            for (int e = 0; e < 4; ++e)
              sum += static_cast<uint32_t>(static_cast<int8_t>(ar[4 * k + e]) *
                                           static_cast<int8_t>(row(b, k)[4 * n + e]));
          std::memcpy(cr + 4 * n, &sum, 4);
          continue;
        }
        // Two chains per output (the even and the odd element of each pair), each a float32
        // FMA from zero, then their sum added to C.
        float even = 0.f, odd = 0.f;
        for (int64_t k = 0; k < kTileGroups; ++k) {
          uint16_t x[2], w[2];
          std::memcpy(x, ar + 4 * k, 4);
          std::memcpy(w, row(b, k) + 4 * n, 4);
          even = ftz(std::fma(bf16_daz(x[0]), bf16_daz(w[0]), even));
          odd = ftz(std::fma(bf16_daz(x[1]), bf16_daz(w[1]), odd));
        }
        float acc;
        std::memcpy(&acc, cr + 4 * n, 4);
        acc = ftz(acc + ftz(even + odd));
        std::memcpy(cr + 4 * n, &acc, 4);
      }
    }
  }
};

// f(HardwareTiles{}) when `hardware`, else f(ModelTiles{}): a kernel's amx loop, written once as
// a generic lambda, on the instructions or on their model (callers have refused the instructions
// where amx_permitted says no; off x86-64 there are none, and the model runs).
template <class F>
inline void on_tiles(bool hardware, const F& f) {
#if defined(__x86_64__)
  if (hardware) return f(HardwareTiles{});
#else
  (void)hardware;
#endif
  f(ModelTiles{});
}

// Configures this thread's tiles for a scope and releases them after.
template <class Tiles>
struct TileScope {
  TileScope() {
    static const TileConfig cfg;
    Tiles::configure(cfg);
  }
  ~TileScope() { Tiles::release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// One weight tile's operands. x's rows are groups [rows rounded up to 16, a_stride], zero past
// the problem's rows and groups (a_stride a multiple of 16), so tiles read zeros there.
struct TileOperands {
  const uint32_t* a;     // the block's first row
  int64_t a_stride;      // groups per row of a
  const uint8_t* w;      // the weight tile: [groups, 32 columns, 4 bytes], groups b_stride bytes apart
  int64_t groups;        // k groups of the weights
  const uint8_t* w_tail; // the last groups % 16 groups, zero-padded to 16 (nullptr when none)
  int64_t b_stride = kGroupBytes;  // bytes from one group of w to the next (a packed weight: 128)
};

// out[r][c] (r < rows <= 32, 32 columns, 32-bit sums: float for bf16, int32 for int8) =
// the rows' sums over every group, through tiles. The caller holds a TileScope.
// One block's sums go to c: rows c_stride bytes apart, 32 columns (128 bytes) per row. With
// `claim_c` the block asks for c's lines (2 per row) a few per step while the tiles multiply, so
// that the stores at the end find them in L1: c is then the GEMM's output itself, whose lines are
// elsewhere. (Storing the tiles into y directly with its lines claimed ahead: ~52 against ~72 ns
// per step of the loop through a 32 x 32 buffer and a copy, measured on a Xeon with AMX.)
template <class Tiles, int TWO>
inline void tile_block(Kind kind, const TileOperands& op, uint8_t* c, int64_t c_stride, bool claim_c) {
  const int64_t a_bytes = op.a_stride * 4;
  Tiles::zero(0);
  Tiles::zero(1);
  if (TWO) {
    Tiles::zero(2);
    Tiles::zero(3);
  }
  // Groups [j, j + 16) of the rows times the 16 groups of weights at b (groups stride bytes apart).
  const int64_t full = op.groups / kTileGroups * kTileGroups;
  constexpr int64_t kLines = (TWO ? kBlockRows : kTileRows) * 2, kLinesPerStep = 4;
  auto step = [&](int64_t j, const uint8_t* b, int64_t stride) {
    if (claim_c)
      for (int64_t line = j / kTileGroups * kLinesPerStep, end = line + kLinesPerStep; line < end && line < kLines; ++line)
        __builtin_prefetch(c + line / 2 * c_stride + line % 2 * 64, 1, 3);
    Tiles::load(4, op.a + j, a_bytes);
    if (TWO) Tiles::load(5, op.a + kTileRows * op.a_stride + j, a_bytes);
    Tiles::load(6, b, stride);
    Tiles::load(7, b + 64, stride);
    Tiles::dot(kind, 0);
    Tiles::dot(kind, 1);
    if (TWO) {
      Tiles::dot(kind, 2);
      Tiles::dot(kind, 3);
    }
  };
  for (int64_t j = 0; j < full; j += kTileGroups) step(j, op.w + j * op.b_stride, op.b_stride);
  if (op.w_tail != nullptr) step(full, op.w_tail, kGroupBytes);  // padded_tail's copy
  Tiles::store(0, c, c_stride);
  Tiles::store(1, c + 64, c_stride);
  if (TWO) {
    Tiles::store(2, c + kTileRows * c_stride, c_stride);
    Tiles::store(3, c + kTileRows * c_stride + 64, c_stride);
  }
}

// tile_block for a block of `rows` rows (<= 32): two A tiles past 16 rows, else one.
template <class Tiles>
inline void tile_block_rows(Kind kind, const TileOperands& op, int64_t rows, uint8_t* c, int64_t c_stride,
                            bool claim_c) {
  if (rows > kTileRows)
    tile_block<Tiles, 1>(kind, op, c, c_stride, claim_c);
  else
    tile_block<Tiles, 0>(kind, op, c, c_stride, claim_c);
}

// The weight tile's last groups % 16 groups zero-padded to a full tile's 16 (into buf,
// 16 x 128 bytes); nullptr when the groups are a multiple of 16.
inline const uint8_t* padded_tail(const uint8_t* w, int64_t groups, uint8_t* buf) {
  const int64_t full = groups / kTileGroups * kTileGroups;
  if (full == groups) return nullptr;
  std::memset(buf, 0, kTileGroups * kGroupBytes);
  std::memcpy(buf, w + full * kGroupBytes, (groups - full) * kGroupBytes);
  return buf;
}

// A weight tile's operands for a block of rows, its last groups % 16 groups (if any) padded in a
// buffer of its own (padded_tail): what each block of the amx loops multiplies.
struct PaddedTile {
  PaddedTile(const uint32_t* a, int64_t a_stride, const uint8_t* w, int64_t groups)
      : op{a, a_stride, w, groups, padded_tail(w, groups, tail)} {}
  PaddedTile(const PaddedTile&) = delete;  // op.w_tail points into this object
  PaddedTile& operator=(const PaddedTile&) = delete;
  alignas(64) uint8_t tail[kTileGroups * kGroupBytes];
  TileOperands op;
};

// block(m, rows, t) for rows [m_begin, m_end) in blocks of 32 (the last one shorter), each block
// across tiles [t_begin, t_end), under one TileScope: the row blocks are the outer loop, so a
// block's rows stay in L1 across the group's tiles and the tiles' weights in L2 across the
// blocks, and a block writes its rows' outputs of the whole group side by side. (One tile at a
// time down all the rows wrote 128 bytes per row and page: a 512-row [576, 3072] product on one
// core of a Xeon with AMX took 71 ns per step of the loop that way, 56 with 16 tiles per block
// of rows.) Every amx loop of the linear kernels runs through here (run_tile_blocks).
template <class Tiles, class Block>
inline void group_blocks(int64_t t_begin, int64_t t_end, int64_t m_begin, int64_t m_end, const Block& block) {
  TileScope<Tiles> scope;
  for (int64_t m = m_begin; m < m_end; m += kBlockRows) {
    const int64_t rows = m_end - m < kBlockRows ? m_end - m : kBlockRows;
    for (int64_t t = t_begin; t < t_end; ++t) block(m, rows, t);
  }
}

// group_blocks for `tiles` tiles and M rows on the pool: items of a panel of rows (panel_rows)
// and a group of tiles (fd_kernels::run_tile_groups).
template <class Tiles, class Block>
inline void run_tile_blocks(int64_t M, int64_t tiles, int64_t panel_rows, const Block& block) {
  fd_kernels::run_tile_groups(M, tiles, panel_rows, [&block](int64_t t_begin, int64_t t_end, int64_t m_begin,
                                                             int64_t m_end) {
    group_blocks<Tiles>(t_begin, t_end, m_begin, m_end, block);
  });
}

// One block of `rows` rows of one weight tile (op) into y's rows (y: the block's first row and the
// tile's first column, y_bytes apart; 64-byte aligned): a block of 32 rows (or of 16) straight
// from the tiles, with y's lines claimed while they multiply, other blocks through a buffer. The
// caller holds a TileScope.
template <class Tiles>
inline void tile_block_into(Kind kind, const TileOperands& op, int64_t rows, uint8_t* y, int64_t y_bytes) {
  if (rows == kBlockRows || rows == kTileRows) return tile_block_rows<Tiles>(kind, op, rows, y, y_bytes, true);
  alignas(64) uint32_t out[kBlockRows][kTileCols];
  tile_block_rows<Tiles>(kind, op, rows, reinterpret_cast<uint8_t*>(&out[0][0]), kTileCols * 4, false);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(y + r * y_bytes, out[r], kTileCols * 4);
}

// Groups per row of x for the tiles: groups rounded up to 16; rows rounded up to 16.
inline int64_t padded_groups(int64_t groups) { return (groups + kTileGroups - 1) / kTileGroups * kTileGroups; }
inline int64_t padded_rows(int64_t rows) { return (rows + kTileRows - 1) / kTileRows * kTileRows; }

}  // namespace fd_amx
