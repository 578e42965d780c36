#pragma once
// PyTorch's Adam `optimizer.state_dict()` with parameter names (DESIGN.md §11): continue
// training in C++ from a PyTorch checkpoint, and hand the state back to torch.load.
//
// PyTorch keys an optimizer's state by integer ids that follow the order its parameters were
// given (`model.parameters()`): {'state': {id: {'step', 'exp_avg', 'exp_avg_sq'}},
// 'param_groups': [{'params': [ids...], 'lr', 'betas', 'eps', 'weight_decay', ...,
// 'param_names': [...] (PyTorch >= 2.6, when built from named_parameters())}]}. The names come
// from `param_names` when the file has them, else from the caller (e.g. the model state dict's
// parameter names, in named_parameters() order); never guessed. Sits in io (files) above
// tensor/optim (the optimizer), as the layers allow.

#include <cstdint>
#include <string>
#include <vector>

#include "treetensor/io/object.hpp"
#include "treetensor/tensor/optim.hpp"

namespace treetensor::io {

/// An Adam state keyed by parameter names; the trees have the params tree's structure
/// (dotted names as paths, as from_state_dict builds them), ready for adam_step().
struct AdamState {
  std::vector<std::string> names;  ///< the parameters in id order (id k is names[k])
  TreeTensor exp_avg, exp_avg_sq;
  std::int64_t step = 0;  ///< steps taken (PyTorch keeps one per parameter; all equal here)
  AdamOptions options;    ///< lr, betas, eps, weight_decay, amsgrad, maximize of the group
};

/// The named state of a loaded `optimizer.state_dict()` with one param group.
/// @param names  the parameters' names in id order; needed when the file has no param_names,
///               and when given they must agree with it.
/// @throws std::invalid_argument naming what is wrong: not an optimizer state dict, more than
///         one param group, no names (saying to pass the names or save with named_parameters()),
///         a count of names different from the group's params, a parameter without state, or
///         steps that differ between parameters.
AdamState adam_state_from(const Object& state_dict, const std::vector<std::string>& names = {});

/// `state` as PyTorch's Adam state dict: ids 0..n-1 in `names` order, steps as float32 0-d
/// tensors (as torch.optim.Adam keeps them), param_names included. Entries of `base`'s param
/// group that are not set here (foreach, capturable, ...) are kept, so that passing the loaded
/// state dict as `base` round trips it; without one, PyTorch's defaults apply on loading.
/// @throws std::invalid_argument when a name has no exp_avg / exp_avg_sq leaf.
Object adam_state_dict(const AdamState& state, const Object& base = {});

}  // namespace treetensor::io
