#pragma once
// A LibTorch module's parameters, gradients and buffers as consolidated trees whose leaves are
// the module's own tensors (DESIGN.md §21, the C++ side of treetensor.nn.consolidate_module):
// one buffer per (dtype, device) where LibTorch holds one tensor per parameter, as FSDP's flat
// parameters, and every parameter's grad() a view into one gradient buffer, as DDP's
// gradient_as_bucket_view. The module trains on views of the buffers, so the flat optimizer
// kernels (tensor/optim.hpp) and the bucketed tree collectives (distributed/) take one buffer
// per call.
//
//   auto model = std::make_shared<Net>();                 // move it first (model->to(device))
//   auto tree = treetensor::nn::consolidate_module(*model);
//   for (auto& [x, y] : data) {
//     tree.zero_grad();                                   // one fill per gradient buffer
//     torch::mse_loss(model->forward(x), y).backward();   // writes into the gradient views
//     treetensor::adam_step_single_pass(tree.params, tree.grads(), m, v, ++step, opts);
//   }
//
// Paths are the module's parameter names split at the dots (named_parameters(): "fc1.weight",
// "layers.0.bias"). What models hold, handled as treetensor.nn does:
//  - a tied parameter (one tensor under two names) is one leaf, at the first name
//    named_parameters() gives; `aliases` maps each other name to it;
//  - frozen parameters (requires_grad false at consolidation) go to `frozen`, outside the
//    gradient buffer;
//  - mixed dtypes and devices: one buffer per (dtype, device), as consolidate() groups;
//  - buffers (BatchNorm's statistics) go to `buffers`, views the module updates in place;
//  - module->zero_grad() (LibTorch's default: grad() undefined) and a grad() replaced by
//    another tensor: grads() copies each new gradient into its view and makes the view grad()
//    again (an undefined one becomes a zero view), so the tree never hands out an older
//    gradient; a sparse gradient (Embedding with sparse(true)) becomes dense there.
// Refused with std::invalid_argument naming the parameter: a parameter or buffer on the meta
// device and two whose memory overlaps (consolidation would separate them), at
// consolidate_module; with std::runtime_error, a parameter moved or converted after it
// (model->to(torch::kDouble): its data no longer lies in the buffer, so a step would train a
// stale copy) and a gradient that requires grad (backward with create_graph), at the next
// grads() or zero_grad(). Not provided here (the Python module has them): overlap of the
// gradient all_reduce with backward (reduce `grads()` with the tree collectives after
// backward instead), checks hooked into load_state_dict.

#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "treetensor/tensor/tree_tensor.hpp"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace treetensor::nn {

/// The trees of one consolidated module (made by consolidate_module). Copies share the trees.
class ModuleTree {
 public:
  /// The trainable parameters (requires_grad at consolidation): a consolidated tree whose
  /// leaves are the module's parameter tensors (the same TensorImpl), views into
  /// `param_buffers`.
  TreeTensor params;
  /// The parameters that did not require grad, consolidated (their own buffers).
  TreeTensor frozen;
  /// The module's buffers (named_buffers()), consolidated.
  TreeTensor buffers;
  /// Tied names -> the name of their leaf ("out.weight" -> "fc.weight").
  std::map<std::string, std::string> aliases;
  /// The 1-D buffers of `params` and of the gradients, one per (dtype, device), in order of
  /// first appearance; the padding between leaves is zero.
  std::vector<at::Tensor> param_buffers, grad_buffers;

  /// The gradient tree, consolidated like `params`: leaf p is params leaf p's grad(). Before
  /// returning it, puts back every grad() that is not its view (see the file comment).
  /// @throws std::runtime_error naming the parameter when one no longer lies in its buffer or
  ///         its gradient requires grad.
  const TreeTensor& grads();

  /// Zeroes every gradient: one fill per gradient buffer (padding included); grad() of each
  /// parameter is its view again.
  /// @throws std::runtime_error as grads() does, before anything is changed.
  void zero_grad();

 private:
  friend ModuleTree consolidate_module(torch::nn::Module& module);
  TreeTensor grads_;
  std::vector<at::Tensor> leaves_, grad_leaves_;  // flatten order
  std::vector<std::string> names_;                // the leaves' dotted names
  std::vector<const void*> data_;                 // each leaf's data pointer at consolidation
  void check(std::size_t i) const;
};

/// Consolidates `module`'s parameters and buffers in place (values copied once into the new
/// buffers, then each tensor's data set to its view: the tensors themselves stay the module's)
/// and lays out a zero gradient buffer whose views become the parameters' grad().
/// Consolidate after moving the model to its device and dtype. Consolidating a module again
/// gives a tree over the same buffers (nothing copied); use only the newest tree then, since
/// each tree's grads() and zero_grad() point grad() at its own gradient buffer.
/// @throws std::invalid_argument naming the tensor(s) for a parameter or buffer on the meta
///         device or with a layout other than strided (sparse, mkldnn), and for two different
///         ones whose memory overlaps. Nothing has changed then.
ModuleTree consolidate_module(torch::nn::Module& module);

}  // namespace treetensor::nn
