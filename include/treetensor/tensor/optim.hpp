#pragma once
// Optimizer math over trees: one Adam step (PyTorch's torch.optim.Adam without amsgrad,
// weight decay added to the gradient, bias correction), in two forms with identical values:
//
//  - adam_step: one tree call whose leaf job runs every stage on one parameter's tensors
//    (while they are in cache, as the hand-written loop does), so every execution strategy
//    applies to the whole step; under stream(fused) it runs as PyTorch's foreach stages.
//  - adam_step_foreach: PyTorch's multi-tensor Adam (`foreach=True`): the same stages as
//    at::_foreach_* calls on the flattened leaf lists — the reference for treetensor-bench's
//    `foreach` row.
//
// Both run the same per-tensor arithmetic in the same order as the hand-written LibTorch loop
//   g = grad + wd·param;  m = m·β1 + (1-β1)·g;  v = v·β2 + (1-β2)·g·g;
//   param -= lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps)
// so on the CPU the results are bitwise equal to that loop.

#include <cstdint>

#include "treetensor/tensor/tree_tensor.hpp"

namespace treetensor {

/// Adam hyper-parameters (LibTorch's AdamOptions shape, fluent setters).
/// Example: AdamOptions().lr(1e-3).betas(0.9, 0.999).weight_decay(1e-4)
struct AdamOptions {
  AdamOptions& lr(double v) { return lr_ = v, *this; }
  AdamOptions& betas(double b1, double b2) { return beta1_ = b1, beta2_ = b2, *this; }
  AdamOptions& eps(double v) { return eps_ = v, *this; }
  AdamOptions& weight_decay(double v) { return weight_decay_ = v, *this; }
  /// Use the maximum of past second moments (needs a max_exp_avg_sq tree; single-pass forms).
  AdamOptions& amsgrad(bool v) { return amsgrad_ = v, *this; }
  /// Maximise the objective: step along +grad (torch.optim's `maximize`).
  AdamOptions& maximize(bool v) { return maximize_ = v, *this; }

  double lr() const noexcept { return lr_; }
  double beta1() const noexcept { return beta1_; }
  double beta2() const noexcept { return beta2_; }
  double eps() const noexcept { return eps_; }
  double weight_decay() const noexcept { return weight_decay_; }
  bool amsgrad() const noexcept { return amsgrad_; }
  bool maximize() const noexcept { return maximize_; }

  /// @throws std::invalid_argument naming the setting when lr < 0, a beta is outside [0, 1),
  ///         eps < 0 or weight_decay < 0.
  void validate() const;

 private:
  double lr_ = 1e-3;
  double beta1_ = 0.9;
  double beta2_ = 0.999;
  double eps_ = 1e-8;
  double weight_decay_ = 0;
  bool amsgrad_ = false;
  bool maximize_ = false;
};

/// SGD hyper-parameters (torch.optim.SGD / torch::optim::SGDOptions names and defaults).
struct SgdOptions {
  explicit SgdOptions(double lr) : lr_(lr) {}
  SgdOptions& lr(double v) { return lr_ = v, *this; }
  SgdOptions& momentum(double v) { return momentum_ = v, *this; }
  SgdOptions& dampening(double v) { return dampening_ = v, *this; }
  SgdOptions& weight_decay(double v) { return weight_decay_ = v, *this; }
  SgdOptions& nesterov(bool v) { return nesterov_ = v, *this; }
  SgdOptions& maximize(bool v) { return maximize_ = v, *this; }

  double lr() const noexcept { return lr_; }
  double momentum() const noexcept { return momentum_; }
  double dampening() const noexcept { return dampening_; }
  double weight_decay() const noexcept { return weight_decay_; }
  bool nesterov() const noexcept { return nesterov_; }
  bool maximize() const noexcept { return maximize_; }

  /// @throws std::invalid_argument naming the setting when lr, momentum or weight_decay < 0,
  ///         or nesterov without momentum > 0 and dampening 0 (torch.optim.SGD's rule).
  void validate() const;

 private:
  double lr_;
  double momentum_ = 0;
  double dampening_ = 0;
  double weight_decay_ = 0;
  bool nesterov_ = false;
  bool maximize_ = false;
};

/// One Adam step, in place on params, exp_avg and exp_avg_sq (floating tensors; the four trees
/// must have the same structure and per-leaf shapes). Runs under at::NoGradGuard.
/// @param params      parameters, updated in place.
/// @param grads       their gradients (read only).
/// @param exp_avg     first moments, updated in place (start from zeros).
/// @param exp_avg_sq  second moments, updated in place (start from zeros).
/// @param step        1-based step number, for the bias corrections.
/// @throws std::invalid_argument for bad options or step < 1; tree::StructureError when the
///         trees differ ("adam_step: key mismatch at '<path>': params has keys {..}, grads has
///         keys {..}", the arguments by name); std::invalid_argument when a leaf of grads,
///         exp_avg or exp_avg_sq differs from its parameter in dtype, device or shape
///         ("adam_step: at 'fc.weight': grads has dtype float64, expected float32 (the dtype
///         of params)"). These are checked before any leaf is updated: the trees are untouched.
///         A leaf's torch error otherwise, with its path, saying which leaves were updated.
/// Thread safety: do not use the same trees from other threads during the call.
void adam_step(TreeTensor& params, const TensorTree& grads, TreeTensor& exp_avg,
               TreeTensor& exp_avg_sq, int64_t step, const AdamOptions& options = {});

// ---- single-pass kernels (DESIGN.md §12) -------------------------------------------------
//
// One pass per element over the parameter, its gradient and its state (Adam: 16 bytes read and
// 12 written per float32 element; the at:: loop streams them several times), vectorised with
// at::vec. The arithmetic is PyTorch's, in its order; results agree with torch::optim to
// rounding (ATen's kernels may fuse a multiply-add where these round twice; tests bound the
// difference by a running error analysis). float32/float64; float16/bfloat16 in float32.
//
// When every tree is consolidated (consolidate.hpp) the kernel runs over each buffer, split
// into pieces of about 256 Ki elements that the current stream mode spreads over lanes;
// otherwise one leaf job per parameter, each one kernel call (leaves that are not contiguous,
// or of another dtype, take the at:: ops instead). In the default (linear) mode a step over
// CPU tensors of more than one piece runs on as many lanes as the caller has ATen intra-op
// threads: the share an ATen kernel or torch's fused Adam takes (one inside a lane, an asyncs
// job or a pending asyncs scope). Runs under at::NoGradGuard and bumps the
// version counter of every tensor it writes, as in-place ATen ops do.
// The trees must have the same structure (tree::StructureError naming the op, the path and
// the arguments by name otherwise) and every leaf its parameter's dtype, device and shape
// (std::invalid_argument naming the op, the path, the argument, the expected and the given
// value), both checked before any leaf is updated, as for adam_step.

/// torch.optim.Adam (weight decay added to the gradient), with amsgrad and maximize.
/// @param max_exp_avg_sq  with amsgrad: the running maximum of exp_avg_sq (start from zeros).
/// @throws std::invalid_argument for bad options, step < 1, or amsgrad without max_exp_avg_sq.
void adam_step_single_pass(TreeTensor& params, const TensorTree& grads, TreeTensor& exp_avg,
                           TreeTensor& exp_avg_sq, int64_t step, const AdamOptions& options = {},
                           TreeTensor* max_exp_avg_sq = nullptr);

/// torch.optim.AdamW: decoupled weight decay (param *= 1 - lr·weight_decay first; note that
/// torch's AdamW defaults weight_decay to 1e-2, AdamOptions to 0).
void adamw_step_single_pass(TreeTensor& params, const TensorTree& grads, TreeTensor& exp_avg,
                            TreeTensor& exp_avg_sq, int64_t step, const AdamOptions& options = {},
                            TreeTensor* max_exp_avg_sq = nullptr);

/// torch.optim.SGD with momentum, dampening, nesterov, weight decay and maximize. On step 1
/// the momentum buffer is set to the (decayed) gradient, as torch's first clone; later steps
/// update it. `momentum_buffer` is unused when momentum is 0.
/// @throws std::invalid_argument for bad options or step < 1.
void sgd_step_single_pass(TreeTensor& params, const TensorTree& grads, TreeTensor& momentum_buffer,
                          int64_t step, const SgdOptions& options);

/// The same step as at::_foreach_* calls over the flattened leaves (PyTorch's foreach Adam).
/// Leaves are matched in flatten order; the structures must be equal (tree::StructureError)
/// and the leaves match as for adam_step (std::invalid_argument), checked before any update.
void adam_step_foreach(TreeTensor& params, const TensorTree& grads, TreeTensor& exp_avg,
                       TreeTensor& exp_avg_sq, int64_t step, const AdamOptions& options = {});

}  // namespace treetensor
