#pragma once
// Building tree tensors: from trees of shapes (DI-treetensor's construction functions), from
// values, from state dicts and IValue nests; and back. Every leaf job goes through
// runtime::run(). Conversions never copy tensor data (the leaves are the same tensors), and
// nothing here ever formats a tensor.
// Thread safety: every function may be called concurrently; the random constructors take the
// default CPU generator's lock while drawing their seeds.

#include <ATen/core/ivalue.h>
#include <c10/core/TensorOptions.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "treetensor/tensor/tree_tensor.hpp"

namespace treetensor {

/// A tensor shape, and a tree of them: `ShapeTree s = {{"a", {2, 3}}, {"b", {{"x", {3, 4}}}}};`
/// (`{}` is a 0-d shape inside a leaf position: write `Shape{}`).
using Shape = std::vector<int64_t>;
using ShapeTree = tree::Tree<Shape>;

/// Trees of the given shapes filled like at::zeros / ones / empty / full (DI-treetensor
/// parity: `ttorch.zeros({'a': (2, 3)})`). `options` (dtype, device, requires_grad, ...)
/// applies to every leaf.
/// @throws as the at:: function, with the leaf path added (e.g. a negative dimension).
TreeTensor zeros(const ShapeTree& shapes, at::TensorOptions options = {});
TreeTensor ones(const ShapeTree& shapes, at::TensorOptions options = {});
TreeTensor empty(const ShapeTree& shapes, at::TensorOptions options = {});
TreeTensor full(const ShapeTree& shapes, const at::Scalar& value, at::TensorOptions options = {});

/// Random trees: normal(0, 1), uniform [0, 1), integers in [low, high) (int64 unless options
/// say otherwise).
///
/// Reproducibility: one 64-bit seed per leaf is drawn from the default CPU generator in
/// flatten order, and each leaf is filled from its own generator (on the CPU, then moved to
/// options' device). So values are identical under every execution strategy (DESIGN.md §5)
/// and repeat after at::manual_seed, but they are not the values a loop of at::randn calls
/// would give.
TreeTensor randn(const ShapeTree& shapes, at::TensorOptions options = {});
TreeTensor rand(const ShapeTree& shapes, at::TensorOptions options = {});
TreeTensor randint(int64_t low, int64_t high, const ShapeTree& shapes,
                   at::TensorOptions options = at::TensorOptions(at::kLong));

/// Tag of the consolidated construction overloads below.
struct Consolidated {
  explicit constexpr Consolidated() = default;
};
inline constexpr Consolidated consolidated{};

/// Consolidated construction (DESIGN.md §12): the same trees as the overloads above, built as
/// one buffer per (dtype, device) laid out as consolidate() lays it out, with one at:: call
/// per buffer, and their leaves made on first access. E.g. `zeros(shapes, {}, consolidated)`.
/// The *_like forms of a consolidated tree (options without dtype or device) share its
/// layout, so flat ops between the two need no layout comparison.
/// Random values: one at::randn / at::rand over each buffer from the default generator, so
/// they repeat after at::manual_seed but differ from the per-leaf overloads' values.
/// With options.requires_grad() the leaves are made at once (fresh autograd leaves).
/// @throws as the at:: function (e.g. a negative dimension, named with the leaf path).
TreeTensor zeros(const ShapeTree& shapes, at::TensorOptions options, Consolidated);
TreeTensor ones(const ShapeTree& shapes, at::TensorOptions options, Consolidated);
TreeTensor empty(const ShapeTree& shapes, at::TensorOptions options, Consolidated);
TreeTensor full(const ShapeTree& shapes, const at::Scalar& value, at::TensorOptions options,
                Consolidated);
TreeTensor randn(const ShapeTree& shapes, at::TensorOptions options, Consolidated);
TreeTensor rand(const ShapeTree& shapes, at::TensorOptions options, Consolidated);
TreeTensor zeros_like(const TensorTree& t, at::TensorOptions options, Consolidated);
TreeTensor ones_like(const TensorTree& t, at::TensorOptions options, Consolidated);
TreeTensor empty_like(const TensorTree& t, at::TensorOptions options, Consolidated);
TreeTensor full_like(const TensorTree& t, const at::Scalar& value, at::TensorOptions options,
                     Consolidated);
TreeTensor randn_like(const TensorTree& t, at::TensorOptions options, Consolidated);
TreeTensor rand_like(const TensorTree& t, at::TensorOptions options, Consolidated);

/// Leaf i holds at::arange(end_i): e.g. arange({{"a", 3}, {"b", 2.5}}).
TreeTensor arange(const tree::Tree<at::Scalar>& ends, at::TensorOptions options = {});

/// The *_like forms: a tree with t's structure and each leaf's shape (and, unless `options`
/// override them, dtype and device), as at::zeros_like etc. Random ones follow the
/// reproducibility rule above.
TreeTensor zeros_like(const TensorTree& t, at::TensorOptions options = {});
TreeTensor ones_like(const TensorTree& t, at::TensorOptions options = {});
TreeTensor empty_like(const TensorTree& t, at::TensorOptions options = {});
TreeTensor full_like(const TensorTree& t, const at::Scalar& value, at::TensorOptions options = {});
TreeTensor randn_like(const TensorTree& t, at::TensorOptions options = {});
TreeTensor rand_like(const TensorTree& t, at::TensorOptions options = {});
TreeTensor randint_like(const TensorTree& t, int64_t low, int64_t high,
                        at::TensorOptions options = {});

/// A tree of 1-D tensors from a tree of values (DI-treetensor's `ttorch.tensor`):
/// tensor({{"a", {1, 2, 3}}, {"b", {{"x", {0.5}}}}}). The dtype is options' dtype, else the
/// default float dtype (as torch.tensor of Python floats).
TreeTensor tensor(const tree::Tree<std::vector<double>>& values, at::TensorOptions options = {});
/// A tree of 0-d tensors from a tree of scalars (integers give int64, floats the default
/// dtype, bools bool, as torch.tensor), unless options give a dtype.
TreeTensor scalars(const tree::Tree<at::Scalar>& values, at::TensorOptions options = {});
/// A tree of tensors sharing the leaves of `t` when they already have options' dtype and
/// device (torch.as_tensor), else converted.
TreeTensor as_tensor(const TensorTree& t, at::TensorOptions options = {});

/// A tree from a state dict or named_parameters(): the dotted key "layer1.0.conv1.weight"
/// becomes the path layer1 → 0 → conv1 → weight. The tensors are shared, not copied.
/// @throws tree::StructureError when a key is both a leaf and the prefix of another key, or
///         appears twice; std::invalid_argument naming the key when it has an empty segment
///         ("a..b", ".a", "a."), or is "" beside other keys.
TreeTensor from_state_dict(const std::map<std::string, at::Tensor>& dict);
TreeTensor from_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& items);
/// The dotted-key state dict of `t` (the inverse of from_state_dict; shares the tensors).
/// A leaf root gives the single key "".
/// @throws std::invalid_argument naming the path when a key is empty or contains '.': the
///         dotted form would read back as another tree (keep such trees as trees).
std::map<std::string, at::Tensor> to_state_dict(const TensorTree& t);

/// A tree from an IValue nest: a tensor is a leaf; a dict with string keys (c10::Dict /
/// c10::impl::GenericDict, e.g. what torch::pickle_load gives for a nested dict) is a node.
/// @throws std::invalid_argument naming the path of a value that is neither (or a non-string
///         key).
TreeTensor from_ivalue(const c10::IValue& value);
/// The IValue nest of `t`, in sorted key order, sharing the tensors, typed as specifically as
/// the tree allows so that TorchScript signatures accept it: a node whose values are all
/// tensors is a `Dict[str, Tensor]`, a node whose children are all dicts of one type T is a
/// `Dict[str, T]` (so a uniform two-level tree is `Dict[str, Dict[str, Tensor]]`), and only a
/// node that mixes kinds (tensors beside dicts, or dicts of different types) is
/// `Dict[str, Any]`. An empty node is a `Dict[str, Tensor]`; a leaf root is the tensor.
c10::IValue to_ivalue(const TensorTree& t);

}  // namespace treetensor
