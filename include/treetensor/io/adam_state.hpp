#pragma once
// PyTorch's Adam `optimizer.state_dict()` with parameter names (DESIGN.md §11): continue
// training in C++ from a PyTorch checkpoint, and hand the state back to torch.load, as
// functions over AdamState values or as an optimizer object (io::Adam) with step().
//
// PyTorch keys an optimizer's state by integer ids that follow the order its parameters were
// given (`model.parameters()`): {'state': {id: {'step', 'exp_avg', 'exp_avg_sq'}},
// 'param_groups': [{'params': [ids...], 'lr', 'betas', 'eps', 'weight_decay', ...,
// 'param_names': [...] (PyTorch >= 2.6, when built from named_parameters())}, ...]} (one entry
// per param group; with amsgrad each state also holds 'max_exp_avg_sq'). The names come
// from `param_names` when the file has them, else from the caller (e.g. the model state dict's
// parameter names, in named_parameters() order); never guessed. Sits in io (files) above
// tensor/optim (the optimizer), as the layers allow.

#include <cstdint>
#include <string>
#include <vector>

#include "treetensor/io/object.hpp"
#include "treetensor/tensor/optim.hpp"

namespace treetensor::io {

/// The Adam state of one param group, keyed by parameter names; the trees have the params
/// tree's structure (dotted names as paths, as from_state_dict builds them), ready for
/// adam_step_single_pass().
struct AdamState {
  std::vector<std::string> names;  ///< the group's parameters in id order
  TreeTensor exp_avg, exp_avg_sq;
  TreeTensor max_exp_avg_sq;  ///< with options.amsgrad(): the running maximum; else empty
  std::int64_t step = 0;      ///< steps taken (PyTorch keeps one per parameter; all equal here)
  AdamOptions options;        ///< lr, betas, eps, weight_decay, amsgrad, maximize of the group
};

/// The named state of every param group of a loaded `optimizer.state_dict()`, in group order.
/// PyTorch numbers the ids across the groups (group 0 holds ids 0..n0-1, group 1 the next, ...).
/// @param names  every group's parameters' names in id order; needed when the file has no
///               param_names, and when given they must agree with it.
/// @throws std::invalid_argument naming what is wrong: not an optimizer state dict, no names
///         (saying to pass the names or save with named_parameters()), a count of names
///         different from the groups' params, a parameter without state (or without
///         max_exp_avg_sq under amsgrad), or steps that differ within a group.
std::vector<AdamState> adam_states_from(const Object& state_dict,
                                        const std::vector<std::string>& names = {});

/// As adam_states_from() for a state dict of exactly one param group.
/// @throws std::invalid_argument as adam_states_from(), and for more than one group.
AdamState adam_state_from(const Object& state_dict, const std::vector<std::string>& names = {});

/// `groups` as PyTorch's Adam state dict: ids 0..n-1 over the groups in order, steps as float32
/// 0-d tensors (as torch.optim.Adam keeps them), param_names included. Entries of `base`'s param
/// groups that are not set here (foreach, capturable, ...) are kept, so that passing the loaded
/// state dict as `base` round trips it; without one, PyTorch's defaults apply on loading.
/// @throws std::invalid_argument when a name has no exp_avg / exp_avg_sq leaf (or, under
///         amsgrad, no max_exp_avg_sq leaf).
Object adam_state_dict(const std::vector<AdamState>& groups, const Object& base = {});
/// One group's state as a state dict (as above).
Object adam_state_dict(const AdamState& state, const Object& base = {});

/// torch.optim.Adam over a tree of parameters, holding its state by parameter names, with
/// PyTorch's load_state_dict() / state_dict(): continue a PyTorch run in C++ from its
/// checkpoint and hand the state back to torch.load. Each param group keeps its own options and
/// step count; step() runs adam_step_single_pass() (torch.optim.Adam's arithmetic, amsgrad and
/// maximize included) on each group's leaves, in place on the params tree's tensors (shared,
/// so a module whose parameters those tensors are trains).
/// Thread safety: one thread at a time per optimizer and params tree.
class Adam {
 public:
  /// A fresh optimizer, as torch.optim.Adam(params, ...): one group of every leaf of `params`,
  /// zero moments, no step taken. `names` (dotted paths) give the ids' order, flatten order by
  /// default; PyTorch's load_state_dict matches parameters by id, so to hand the state to a
  /// torch.optim.Adam(model.parameters()), pass the model's named_parameters() order (a loaded
  /// state dict's Object::key_order has it).
  /// @throws std::invalid_argument for bad options, or `names` not naming every leaf once.
  explicit Adam(TreeTensor params, AdamOptions options = {},
                const std::vector<std::string>& names = {});

  /// torch.optim.Optimizer.load_state_dict: every group's options, step and moments from a
  /// loaded `optimizer.state_dict()` (names as adam_states_from takes them). The groups must
  /// name every leaf of the params tree once, with moments of its shape, dtype and device.
  /// @throws std::invalid_argument naming the parameter otherwise; the optimizer is unchanged.
  void load_state_dict(const Object& state_dict, const std::vector<std::string>& names = {});

  /// One step with `grads` (the params tree's structure): each group with its options.
  /// @throws as adam_step_single_pass(), before any leaf is updated.
  void step(const TensorTree& grads);

  /// The state as PyTorch's Adam state dict (adam_state_dict(groups(), base)).
  Object state_dict(const Object& base = {}) const;

  const std::vector<AdamState>& groups() const noexcept { return groups_; }
  const TreeTensor& params() const noexcept { return params_; }

 private:
  TreeTensor params_;
  std::vector<AdamState> groups_;
};

}  // namespace treetensor::io
