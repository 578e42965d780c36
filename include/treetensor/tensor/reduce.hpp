#pragma once
// Reductions (DESIGN.md §4), under two explicit families of names:
//
//  - tree-level: sum, mean, all, any, min, max, std, norm, masked_select — ONE tensor over
//    every element of every leaf, element-weighted: mean of leaves [2,3,4] and [[5,6],[7,8]] is
//    35/7 = 5, not the mean of the leaf means. (DI-treetensor's `t.sum()` without dim.)
//  - per-leaf: leaf_sum, leaf_mean, leaf_all, leaf_any, leaf_min, leaf_max, leaf_std,
//    leaf_norm, leaf_masked_select — a tree with one result per leaf, optionally along `dim`
//    (DI-treetensor's `ttorch.sum(t, dim=0)`).
//
// The per-leaf partial results are computed through runtime::run() (so lanes apply); the
// tree-level combination is one small at:: op on the stacked partials, so gradients flow
// through both. Leaves may be non-contiguous. Mixed dtypes are promoted as torch promotes them.
//
// Empty trees (no leaves) and trees without elements:
//   sum → 0 (the default dtype for an empty tree, as torch.sum(torch.tensor([]))), mean → nan, all
//   → true, any → false, norm → 0 (p = ±inf: c10::Error, as torch 2.x), std → nan, masked_select →
//   an empty 1-D tensor; min/max throw std::invalid_argument
//   ("no elements"), as at::min of an empty tensor does. Leaves with no elements contribute
//   nothing to min/max.
//
// Errors: a leaf's torch error with the op and leaf path added; mean or std of a tree whose
// leaves are all integral or bool is a c10::Error naming a leaf (torch.cat of the leaves would
// be integral: as at::mean's; Python: RuntimeError, as torch's).
// Thread safety: as at::Tensor.

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "treetensor/tensor/tree_tensor.hpp"

namespace treetensor {

// ---- tree-level -------------------------------------------------------------------------------
/// The tree-level reductions whose result dtype reduction_dtype() gives.
enum class Reduction { sum, mean, all, any, min, max, std };

/// The dtype the tree-level reduction `r` of `t` returns, from the leaves' dtypes alone (the
/// buffers' on a consolidated tree; no data is read): all/any bool; sum torch's promotion with
/// integral and bool leaves as int64; mean the promotion; std its real type; min/max the
/// promotion over the leaves that have elements. nullopt where the result is a constant in the
/// default dtype (a tree without leaves; min/max of a tree without elements, which throws).
/// Integral-only mean and std have the integral dtype here and throw when computed.
std::optional<at::ScalarType> reduction_dtype(Reduction r, const TensorTree& t);

/// Sum of every element of every leaf (dtype: torch's promotion of the leaves' sum dtypes).
at::Tensor sum(const TensorTree& t);
/// Element-weighted mean over every element of every leaf, in the leaves' promoted dtype (as
/// at::mean of torch.cat of them: floating or complex).
at::Tensor mean(const TensorTree& t);
/// Whether every / any element of every leaf is nonzero (a bool 0-d tensor).
at::Tensor all(const TensorTree& t);
at::Tensor any(const TensorTree& t);
/// Smallest / largest element over every leaf. @throws std::invalid_argument when there is no
/// element at all.
at::Tensor min(const TensorTree& t);
at::Tensor max(const TensorTree& t);
/// Standard deviation of every element of every leaf taken as one sample (two passes: the
/// tree-level mean, then the squared deviations), unbiased (n - 1) by default.
at::Tensor std(const TensorTree& t, bool unbiased = true);
/// p-norm of every element of every leaf as one vector, as at::norm of their concatenation for
/// every p torch accepts: finite p != 0 as the p-norm of the leaf p-norms; p = 0 the number of
/// nonzero elements; p = inf / -inf the largest / smallest |x| over the elements that exist
/// (0-element leaves contribute nothing). With no element at all, at::norm of an empty tensor
/// (0, or for p = ±inf the c10::Error torch 2.x raises: that norm has no identity).
at::Tensor norm(const TensorTree& t, double p = 2);
/// Every leaf's elements where the mask is true, concatenated in flatten order into one 1-D
/// tensor (DI-treetensor's masked_select). `mask` is a tree of bool tensors or one tensor.
at::Tensor masked_select(const TensorTree& t, const Operand& mask);

// ---- per-leaf ---------------------------------------------------------------------------------
TreeTensor leaf_sum(const TensorTree& t);
TreeTensor leaf_sum(const TensorTree& t, at::IntArrayRef dim, bool keepdim = false);
TreeTensor leaf_mean(const TensorTree& t);
TreeTensor leaf_mean(const TensorTree& t, at::IntArrayRef dim, bool keepdim = false);
TreeTensor leaf_all(const TensorTree& t);
TreeTensor leaf_all(const TensorTree& t, int64_t dim, bool keepdim = false);
TreeTensor leaf_any(const TensorTree& t);
TreeTensor leaf_any(const TensorTree& t, int64_t dim, bool keepdim = false);
TreeTensor leaf_min(const TensorTree& t);
TreeTensor leaf_max(const TensorTree& t);
/// (values, indices) along dim, as at::min(t, dim) / at::max(t, dim).
std::tuple<TreeTensor, TreeTensor> leaf_min(const TensorTree& t, int64_t dim, bool keepdim = false);
std::tuple<TreeTensor, TreeTensor> leaf_max(const TensorTree& t, int64_t dim, bool keepdim = false);
TreeTensor leaf_std(const TensorTree& t, bool unbiased = true);
TreeTensor leaf_std(const TensorTree& t, at::IntArrayRef dim, bool unbiased = true,
                    bool keepdim = false);
TreeTensor leaf_norm(const TensorTree& t, double p = 2);
/// Leaf-wise at::masked_select (a tree of 1-D tensors).
TreeTensor leaf_masked_select(const TensorTree& t, const Operand& mask);

}  // namespace treetensor
