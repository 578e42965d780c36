// Picks the single-pass kernels' instruction set at run time (optim_kernels_isa.cpp): AVX2
// where the CPU has it, else the portable build. Both compute the same bits.
#include "tensor/optim_kernels.hpp"

#include <ATen/ATen.h>

namespace treetensor::detail {

#define TREETENSOR_DECLARE_KERNELS(isa)                                                        \
  namespace isa {                                                                              \
  void adam_kernel(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, \
                   const at::Tensor&, const AdamScalars&, int64_t, int64_t);                   \
  void sgd_kernel(const at::Tensor&, const at::Tensor&, const at::Tensor&, const SgdScalars&,  \
                  int64_t, int64_t);                                                           \
  }
TREETENSOR_DECLARE_KERNELS(isa_default)
#if defined(__x86_64__)
TREETENSOR_DECLARE_KERNELS(isa_avx2)
#endif
#undef TREETENSOR_DECLARE_KERNELS

namespace {
bool has_avx2() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return yes;
#else
  return false;
#endif
}
}  // namespace

void adam_kernel(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                 const at::Tensor& vmax, const AdamScalars& s, int64_t begin, int64_t end) {
#if defined(__x86_64__)
  if (has_avx2()) return isa_avx2::adam_kernel(p, g, m, v, vmax, s, begin, end);
#endif
  isa_default::adam_kernel(p, g, m, v, vmax, s, begin, end);
}

void sgd_kernel(const at::Tensor& p, const at::Tensor& g, const at::Tensor& buf,
                const SgdScalars& s, int64_t begin, int64_t end) {
#if defined(__x86_64__)
  if (has_avx2()) return isa_avx2::sgd_kernel(p, g, buf, s, begin, end);
#endif
  isa_default::sgd_kernel(p, g, buf, s, begin, end);
}

bool kernel_ready(std::initializer_list<const at::Tensor*> tensors) {
  const at::Tensor& first = **tensors.begin();
  const auto dtype = first.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble && dtype != at::kHalf && dtype != at::kBFloat16)
    return false;
  for (const at::Tensor* t : tensors)
    if (!t->defined() || !t->is_contiguous() || t->scalar_type() != dtype ||
        !t->device().is_cpu() || t->numel() != first.numel())
      return false;
  return true;
}

}  // namespace treetensor::detail
