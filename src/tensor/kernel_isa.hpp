#pragma once
// Which build of the per-instruction-set kernels runs (optim_kernels_isa.cpp,
// fuse_kernels_isa.cpp; CMakeLists.txt builds each once per set): the one for ATen's own
// choice, at::get_cpu_capability(), so the CPU and the ATEN_CPU_CAPABILITY variable pick ours
// as they pick ATen's kernels.

#include <ATen/Version.h>

#include <string>

namespace treetensor::detail {

enum class KernelIsa { portable, avx2, avx512 };

/// ATen's instruction set as a KernelIsa, read once per process (not a string per leaf).
inline KernelIsa kernel_isa() {
#if defined(__x86_64__)
  static const KernelIsa isa = [] {
    const std::string c = at::get_cpu_capability();
    return c == "AVX512" ? KernelIsa::avx512 : c == "AVX2" ? KernelIsa::avx2 : KernelIsa::portable;
  }();
  return isa;
#else
  return KernelIsa::portable;
#endif
}

}  // namespace treetensor::detail
