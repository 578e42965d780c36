#pragma once
// Consolidation (tensordict's word; DESIGN.md §12): every leaf a contiguous view into one
// buffer per (dtype, device) group, in flatten order, each leaf starting 64-byte aligned.
// Saving, sending and the single-pass optimizer kernels then see one buffer per group.
//
// This is the first step of DESIGN.md §12: leaves are materialised views (so every tree
// algorithm and op works on a consolidated tree unchanged), and is_consolidated() checks the
// leaves (O(leaves) pointer and offset comparisons, about a nanosecond each), so replacing a
// leaf or changing the structure is always noticed. Elementwise ops on consolidated trees still
// run per leaf; the single-pass optimizer steps (optim.hpp) run over whole buffers.

#include <vector>

#include "treetensor/tensor/tree_tensor.hpp"

namespace treetensor {

/// The alignment of every leaf's first element in a consolidated buffer, bytes.
inline constexpr int64_t kConsolidateAlignment = 64;

/// A copy of `t` whose leaves are contiguous views into one buffer per (dtype, device), in
/// flatten order, each starting at a multiple of 64 bytes (padding is zero). Leaves keep their
/// dtype, device, shape and values; requires_grad is kept (the views are fresh leaves).
/// A tree that is already consolidated is returned as is (same tensors, no copy).
/// @throws std::invalid_argument naming the path of an undefined leaf.
TreeTensor consolidate(const TensorTree& t);

/// Whether every leaf of `t` is a contiguous view into one buffer per (dtype, device) laid out
/// as consolidate() lays it out (flatten order, 64-byte aligned, starting at the buffer's
/// first byte, nothing else in the buffer). O(leaves).
bool is_consolidated(const TensorTree& t);

/// One (dtype, device) group of a consolidated tree: its buffer (1-D, the group's dtype, all of
/// the storage) and the [offset, offset + numel) element ranges of its leaves, in flatten order.
struct ConsolidatedGroup {
  at::Tensor buffer;
  std::vector<std::pair<int64_t, int64_t>> ranges;
};

/// The groups of a consolidated tree in order of first appearance; empty when `t` is not
/// consolidated.
std::vector<ConsolidatedGroup> consolidated_groups(const TensorTree& t);

}  // namespace treetensor
