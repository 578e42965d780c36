// Picks the single-pass kernels' instruction set at run time (optim_kernels_isa.cpp): ATen's own
// (kernel_isa.hpp), AVX2 where that is AVX-512. Every build computes the same bits.
#include "tensor/optim_kernels.hpp"

#include <ATen/ATen.h>

#include <stdexcept>
#include <string>

#include "tensor/kernel_isa.hpp"

namespace treetensor::detail {

namespace {

OptimDtype optim_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return OptimDtype::f32;
    case at::kDouble:
      return OptimDtype::f64;
    case at::kHalf:
      return OptimDtype::f16;
    case at::kBFloat16:
      return OptimDtype::bf16;
    default:
      throw std::invalid_argument(std::string("single-pass optimizer: dtype ") +
                                  c10::toString(dtype) +
                                  " (float32, float64, float16 or bfloat16 expected)");
  }
}

void* ptr(const at::Tensor& t) {
  return t.defined() ? t.data_ptr() : nullptr;
}

}  // namespace

void adam_kernel(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                 const at::Tensor& vmax, const AdamScalars& s, int64_t begin, int64_t end) {
  const OptimDtype dtype = optim_dtype(p.scalar_type());
  const AdamPointers t{ptr(p), g.const_data_ptr(), ptr(m), ptr(v), s.amsgrad ? ptr(vmax) : nullptr};
#if defined(__x86_64__)
  if (kernel_isa() != KernelIsa::portable) return isa_avx2::adam_kernel(dtype, t, s, begin, end);
#endif
  isa_default::adam_kernel(dtype, t, s, begin, end);
}

void sgd_kernel(const at::Tensor& p, const at::Tensor& g, const at::Tensor& buf,
                const SgdScalars& s, int64_t begin, int64_t end) {
  const OptimDtype dtype = optim_dtype(p.scalar_type());
  const SgdPointers t{ptr(p), g.const_data_ptr(), s.momentum != 0 ? ptr(buf) : nullptr};
#if defined(__x86_64__)
  if (kernel_isa() != KernelIsa::portable) return isa_avx2::sgd_kernel(dtype, t, s, begin, end);
#endif
  isa_default::sgd_kernel(dtype, t, s, begin, end);
}

bool kernel_ready(std::initializer_list<const at::Tensor*> tensors) {
  const at::Tensor& first = **tensors.begin();
  const auto dtype = first.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble && dtype != at::kHalf && dtype != at::kBFloat16)
    return false;
  for (const at::Tensor* t : tensors)
    if (!t->defined() || !t->is_contiguous() || t->scalar_type() != dtype ||
        !t->device().is_cpu() || t->numel() != first.numel() || t->is_neg())  // the bit: at::
      return false;
  return true;
}

}  // namespace treetensor::detail
