#pragma once
// Consolidation (tensordict's word; DESIGN.md §12): every leaf a contiguous view into one
// buffer per (dtype, device) group, in flatten order, each leaf starting 64-byte aligned.
// Saving, sending and the single-pass optimizer kernels then see one buffer per group, and
// elementwise ops run as one ATen call per buffer (flat execution, dispatch.hpp).
//
// A consolidated tree carries its buffers and layout as a property of the tree value (a
// tree::Tree source, see Tree::deferred): is_consolidated() is O(1), and the property is
// dropped when the structure changes or a leaf is replaced (any non-const access). Op results
// on consolidated trees are deferred trees: their leaf tensors (views of the buffers) are made
// only on first access, so a chain of ops never creates per-leaf tensors.

#include <memory>
#include <mutex>
#include <vector>

#include "treetensor/tensor/tree_tensor.hpp"
#include "treetensor/tree/flatten.hpp"

namespace treetensor {

/// The alignment of every leaf's first element in a buffer made by consolidate(), bytes.
inline constexpr int64_t kConsolidateAlignment = 64;

/// Where each leaf of a consolidated tree lives: its group (buffer), element offset and shape.
/// Immutable and shared by every tree of that layout (a chain of ops never copies it).
/// Offsets are in elements, so an op result whose element size differs from its operand's
/// (a comparison's bool, a promoted dtype) keeps its operands' layout: its leaves start at
/// 64·size(result)/size(operand)-byte boundaries instead of 64.
class ConsolidatedLayout {
 public:
  /// The layout consolidate() gives leaves of these shapes and element sizes (bytes), grouped
  /// by `group` (group ids 0, 1, ... in order of first appearance).
  ConsolidatedLayout(tree::TreeSpec spec, const std::vector<std::size_t>& group,
                     const std::vector<at::IntArrayRef>& sizes,
                     const std::vector<int64_t>& element_size);

  const tree::TreeSpec& spec() const noexcept { return spec_; }
  std::size_t leaves() const noexcept { return group_.size(); }
  std::size_t groups() const noexcept { return group_numel_.size(); }
  std::size_t group(std::size_t leaf) const { return group_[leaf]; }
  /// Leaf `leaf`'s first element in its group's buffer, elements.
  int64_t offset(std::size_t leaf) const { return offset_[leaf]; }
  int64_t numel(std::size_t leaf) const { return numel_[leaf]; }
  at::IntArrayRef sizes(std::size_t leaf) const;
  /// Elements in group g's buffer (leaves and the padding between them).
  int64_t group_numel(std::size_t g) const { return group_numel_[g]; }
  /// Elements of all leaves (padding excluded).
  int64_t total_numel() const noexcept { return total_numel_; }
  /// No padding anywhere: every buffer element belongs to a leaf.
  bool dense() const noexcept { return dense_; }
  /// Some leaf is 0-d (type promotion then differs between a leaf and the buffer).
  bool has_scalar_leaf() const noexcept { return has_scalar_leaf_; }
  /// A bool mask of group g's buffer, true on leaf elements (made once, then cached).
  at::Tensor mask(std::size_t g, at::Device device) const;

  /// A hash of the structure, groups, offsets and shapes (equal layouts hash equal).
  std::size_t hash() const noexcept;
  /// Same structure, groups, offsets and shapes (O(leaves) integer compares).
  friend bool operator==(const ConsolidatedLayout& a, const ConsolidatedLayout& b);

 private:
  tree::TreeSpec spec_;
  std::vector<std::size_t> group_;
  std::vector<int64_t> offset_, numel_;
  std::vector<std::size_t> dims_begin_;  // leaf i's sizes: sizes_[dims_begin_[i], [i + 1])
  std::vector<int64_t> sizes_;
  std::vector<int64_t> group_numel_;
  int64_t total_numel_ = 0;
  bool dense_ = true, has_scalar_leaf_ = false;
  mutable std::mutex mask_mutex_;
  mutable std::vector<at::Tensor> masks_;
};

/// The property a consolidated tree carries: its buffers (one 1-D tensor per group, each
/// `layout->group_numel(g)` elements of the group's dtype and device) and layout. make()
/// builds the leaves as views of the buffers (what a deferred result shows on first access).
class ConsolidatedTree final : public TensorTree::Source {
 public:
  /// Records the buffers' storage as consolidated buffers (see consolidate()).
  ConsolidatedTree(std::shared_ptr<const ConsolidatedLayout> layout,
                   std::vector<at::Tensor> buffers);
  const ConsolidatedLayout& layout() const noexcept { return *layout_; }
  const std::shared_ptr<const ConsolidatedLayout>& layout_ptr() const noexcept { return layout_; }
  const std::vector<at::Tensor>& buffers() const noexcept { return buffers_; }
  /// Leaf `leaf` as a view of its buffer (contiguous, the layout's shape).
  at::Tensor leaf_view(std::size_t leaf) const;
  TensorTree make() const override;
  /// Whether every leaf of `t` (a tree of this layout's structure) still is what leaf_view()
  /// would make: same dtype and device, in its buffer's storage at its offset, contiguous with
  /// its shape. O(leaves).
  bool describes(const TensorTree& t) const;

 private:
  std::shared_ptr<const ConsolidatedLayout> layout_;
  std::vector<at::Tensor> buffers_;
};

/// The consolidated property of `t`, or nullptr. A tree whose leaves have been made also needs
/// them to be as the property lays them out (ConsolidatedTree::describes, O(leaves)): a leaf
/// reshaped, transposed, resized or pointed at other memory in place (through a reference the
/// caller held) has left its buffer, and flat calls would read and write the buffer instead;
/// the tree then has lost the property. O(1) for a deferred tree (its leaves are made from the
/// buffers). A pending tree (an asyncs pending result, DESIGN.md §10) is waited for first, and
/// its job's error thrown.
const ConsolidatedTree* consolidated_source(const TensorTree& t);

/// A tree of `layout` over `buffers` whose leaves are made on first access (DESIGN.md §12).
TreeTensor consolidated_tree(std::shared_ptr<const ConsolidatedLayout> layout,
                             std::vector<at::Tensor> buffers);

/// A copy of `t` whose leaves are contiguous views into one buffer per (dtype, device), in
/// flatten order, each starting at a multiple of 64 bytes (padding is zero). Leaves keep their
/// dtype, device, shape and values; requires_grad is kept, but the views are fresh autograd
/// leaves, made at once: no history is carried, so gradients of the result never reach `t`'s
/// leaves or what made them (each leaf is as x.detach().clone() with x's requires_grad, not as
/// torch's clone()); without autograd the views are made on first access. Trees of equal layout
/// share one layout object (compared by pointer in flat calls). A consolidated tree is returned as
/// is (O(1)); a tree whose leaves already lie in buffers as consolidate() lays them out (e.g. one
/// that lost the property to a mutation) gets the property back without a copy (O(leaves)),
/// provided each group's storage is one that held a consolidated tree's buffer (flat calls write
/// the padding between leaves, which must not be another tensor's data) and no two groups share
/// storage; otherwise every leaf is copied once.
/// @throws std::invalid_argument naming the path of an undefined leaf.
TreeTensor consolidate(const TensorTree& t);

/// Whether `t` carries the consolidated property (consolidate(), a consolidated
/// construction, or an op on consolidated trees) and its leaves are still where the property
/// says (consolidated_source). O(1) while its leaves have not been made, else O(leaves). An
/// empty tree counts as consolidated.
bool is_consolidated(const TensorTree& t);

/// One (dtype, device) group of a consolidated tree: its buffer (1-D, the group's dtype, all of
/// the storage) and the [offset, offset + numel) element ranges of its leaves, in flatten order.
struct ConsolidatedGroup {
  at::Tensor buffer;
  std::vector<std::pair<int64_t, int64_t>> ranges;
};

/// The groups of a consolidated tree in order of first appearance. A tree without the property
/// whose leaves lie as consolidate() lays them out is recognised too (O(leaves)); otherwise
/// empty.
std::vector<ConsolidatedGroup> consolidated_groups(const TensorTree& t);

}  // namespace treetensor
