#pragma once
// Single-pass optimizer kernels (DESIGN.md §12): per element, one read of the parameter, its
// gradient and its state and one write of the parameter and state, vectorised with
// at::vec::Vectorized (builds on LibTorch 1.13 and 2.x; no -ffast-math, no FMA contraction, so
// the vector body and the scalar tail compute the same bits). float32 and float64 natively;
// float16 and bfloat16 computed in float32.
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
void adam_kernel(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                 const at::Tensor& vmax, const AdamScalars& s, int64_t begin, int64_t end);

/// Elements [begin, end) of contiguous, same-dtype p, g and momentum buffer (undefined when
/// momentum is 0): one SGD step in place on p and the buffer (the first step sets the buffer
/// to the gradient, as torch.optim.SGD's clone does).
void sgd_kernel(const at::Tensor& p, const at::Tensor& g, const at::Tensor& buf,
                const SgdScalars& s, int64_t begin, int64_t end);

/// Whether the kernels take these tensors as they are: defined, contiguous, one dtype of
/// float32/float64/float16/bfloat16, one device (CPU), equal numel.
bool kernel_ready(std::initializer_list<const at::Tensor*> tensors);

}  // namespace treetensor::detail
