// Buffers that start on a cache line: a kernel's own scratch rows, read and written 64 bytes
// (one AVX-512 vector, or an AMX tile row) at a time.
//
// std::vector's default allocation is 16-byte aligned (a large one sits 16 bytes past a page
// start), so every 64-byte load of its 16-float rows spans two cache lines. Measured where it
// mattered: an AMX tile row across two lines halved the loads' speed (Xeon with AMX, 70-75
// against 32 ns per step of four loads and four products from L1); fd_f32_linear's loop over a
// widened tile ran ~1.3x slower at 64 rows (Ice Lake Xeon); the score products of a prompt's
// attention item, one core, 104-119 against 144-152 GFLOP/s (Ice Lake Xeon, benchmarks/perf_cpu.md).
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace fd_kernels {

template <class T>
struct LineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  LineAllocator() = default;
  template <class U>
  LineAllocator(const LineAllocator<U>&) {}  // NOLINT: rebinding, as the standard containers do
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlign); }
  template <class U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};

template <class T>
using LineBuffer = std::vector<T, LineAllocator<T>>;

}  // namespace fd_kernels
