#pragma once
// Single-pass optimizer kernels (DESIGN.md §12): per element, one read of the parameter, its
// gradient and its state and one write of the parameter and state, vectorised with
// at::vec::Vectorized (builds on LibTorch 1.13 and 2.x; no -ffast-math, no FMA contraction, so
// the vector body and the scalar tail compute the same bits). float32 and float64 natively;
// float16 and bfloat16 computed in float32. Built once per instruction set (portable, AVX2) and
// chosen as ATen chooses its own kernels (kernel_isa.hpp; AVX2 where ATen's is AVX-512).
//
// The arithmetic is PyTorch's (torch/optim/adam.py, adamw.py, sgd.py; LibTorch's
// torch::optim::Adam / AdamW / SGD), in its operation order, with the scalars cast to the
// compute type as ATen casts a Scalar operand.

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace treetensor::detail {

/// Adam / AdamW step scalars, precomputed once per step (double; cast per dtype by the kernel).
struct AdamScalars {
  double beta1, beta2, eps, weight_decay;
  double step_size;     ///< lr / (1 - beta1^t)
  double bias2_sqrt;    ///< sqrt(1 - beta2^t)
  double decay_factor;  ///< AdamW: 1 - lr * weight_decay
  bool decoupled = false, amsgrad = false, maximize = false;
};

/// SGD step scalars.
struct SgdScalars {
  double lr, momentum, dampening, weight_decay;
  bool nesterov = false, maximize = false, first_step = false;
};

/// Elements [begin, end) of contiguous, same-dtype tensors p, g, m, v (and vmax when amsgrad;
/// else undefined): one Adam/AdamW step in place on p, m, v, vmax.
/// @throws std::invalid_argument for a dtype other than float32/64, float16, bfloat16.
void adam_kernel(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                 const at::Tensor& vmax, const AdamScalars& s, int64_t begin, int64_t end);

/// Elements [begin, end) of contiguous, same-dtype p, g and momentum buffer (undefined when
/// momentum is 0): one SGD step in place on p and the buffer (the first step sets the buffer
/// to the gradient, as torch.optim.SGD's clone does).
/// @throws std::invalid_argument for a dtype other than float32/64, float16, bfloat16.
void sgd_kernel(const at::Tensor& p, const at::Tensor& g, const at::Tensor& buf,
                const SgdScalars& s, int64_t begin, int64_t end);

/// Whether the kernels take these tensors as they are: defined, contiguous, one dtype of
/// float32/float64/float16/bfloat16, one device (CPU), equal numel, no negative view bit (the
/// kernels read raw storage).
bool kernel_ready(std::initializer_list<const at::Tensor*> tensors);

/// The kernel ABI below: raw pointers and plain structs only, so that the per-instruction-set
/// files instantiate no inline code of other libraries (their copy, compiled with AVX2 flags,
/// could be the one the linker keeps for the whole program).
enum class OptimDtype : std::uint8_t { f32, f64, f16, bf16 };
/// First elements of one step's tensors; vmax is nullptr without amsgrad.
struct AdamPointers {
  void* p;
  const void* g;
  void* m;
  void* v;
  void* vmax;
};
/// First elements of one step's tensors; buf is nullptr without momentum.
struct SgdPointers {
  void* p;
  const void* g;
  void* buf;
};

/// The kernels, once per instruction set (namespaces isa_default, isa_avx2 of
/// treetensor::detail; optim_kernels_isa.cpp). No AVX-512 build: a step is memory-bound, and
/// one measured no faster than AVX2.
#define TREETENSOR_DECLARE_OPTIM_KERNELS(isa)                                                      \
  namespace isa {                                                                                  \
  void adam_kernel(OptimDtype dtype, const AdamPointers& t, const AdamScalars& s,                  \
                   std::int64_t begin, std::int64_t end);                                          \
  void sgd_kernel(OptimDtype dtype, const SgdPointers& t, const SgdScalars& s, std::int64_t begin, \
                  std::int64_t end);                                                               \
  }
TREETENSOR_DECLARE_OPTIM_KERNELS(isa_default)
TREETENSOR_DECLARE_OPTIM_KERNELS(isa_avx2)
#undef TREETENSOR_DECLARE_OPTIM_KERNELS

}  // namespace treetensor::detail
