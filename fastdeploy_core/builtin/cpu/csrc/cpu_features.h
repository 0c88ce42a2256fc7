// CPU features the kernels choose their paths by at run time (the library is built with
// -march=native, but a path compiled through a target attribute still needs the CPU to have it).
#pragma once

namespace fd_kernels {

// AVX-512 BF16 (vdpbf16ps) with AVX-512 BW: the bfloat16 dot paths of fd_bf16_linear and of
// attention over a bfloat16 KV cache. __builtin_cpu_supports also asks the OS for the AVX-512
// register state.
inline bool cpu_has_bf16_dot() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  return has;
#else
  return false;
#endif
}

}  // namespace fd_kernels
