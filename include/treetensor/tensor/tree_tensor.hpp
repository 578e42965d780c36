#pragma once
// TreeTensor: a Tree<at::Tensor> whose tensor operations apply leaf-wise through the runtime's
// single dispatch point (DESIGN.md, tensor layer). This header declares the class, its
// methods (those of the op registry generated from codegen/ops.toml) and the argument type
// of every leaf-wise op.

#include <ATen/TensorIndexing.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdint>
#include <iosfwd>
#include <ranges>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "treetensor/tree/tree.hpp"

namespace treetensor {

using tree::Path;
using tree::ZipMode;
using tree::ZipOptions;

/// A plain tree of tensors (the base of TreeTensor).
using TensorTree = tree::Tree<at::Tensor>;

/// An argument of a leaf-wise op: a tree of tensors (zipped key by key with the other tree
/// arguments) or a single tensor or scalar (broadcast to every leaf, DESIGN.md §2).
///
/// An Operand borrows what it was made from: it is meant to live only for one call, as a
/// parameter type (`add(tree, 1.5)`, `mul(tree, tensor)`, `where(mask, a, 0)`).
class Operand {
 public:
  enum class Kind : std::uint8_t { tree, tensor, scalar };

  Operand(const TensorTree& t) noexcept : kind_(Kind::tree), tree_(&t) {}      // NOLINT
  Operand(const at::Tensor& t) noexcept : kind_(Kind::tensor), tensor_(&t) {}  // NOLINT
  Operand(const at::Scalar& s) : kind_(Kind::scalar), scalar_(s) {}            // NOLINT
  /// Any C++ number: integers become int64 scalars, floating values double, bool stays bool
  /// (torch's scalar type promotion then applies: an int tree plus 1.5 is a float tree).
  template <class N>
  requires std::is_arithmetic_v<N> Operand(N v)
      : kind_(Kind::scalar), scalar_(to_scalar(v)) {}  // NOLINT

  Kind kind() const noexcept { return kind_; }
  bool is_tree() const noexcept { return kind_ == Kind::tree; }
  const TensorTree& tree() const { return *tree_; }
  const at::Tensor& tensor() const { return *tensor_; }
  const at::Scalar& scalar() const { return scalar_; }

 private:
  template <class N>
  static at::Scalar to_scalar(N v) {
    if constexpr (std::is_same_v<N, bool>)
      return at::Scalar(v);
    else if constexpr (std::is_integral_v<N>)
      return at::Scalar(static_cast<int64_t>(v));
    else
      return at::Scalar(static_cast<double>(v));
  }

  Kind kind_;
  const TensorTree* tree_ = nullptr;
  const at::Tensor* tensor_ = nullptr;
  at::Scalar scalar_;
};

/// A tensor's shape as torch.Size: a std::vector<int64_t> (it compares equal to one) that
/// prints as PyTorch does, `torch.Size([2, 3])`, and `torch.Size([])` for a 0-d tensor.
struct Size : std::vector<int64_t> {
  using std::vector<int64_t>::vector;
  Size() = default;
  Size(std::vector<int64_t> v) noexcept : std::vector<int64_t>(std::move(v)) {}  // NOLINT
};
std::ostream& operator<<(std::ostream& os, const Size& s);

/// A tree whose leaves are tensors, with the tensor API applied leaf-wise (DI-treetensor
/// parity). It IS a Tree<at::Tensor> (TreeLike), so every tree algorithm (map, zip_map,
/// flatten, filter, subside/rise, print) works on it; their Tree<at::Tensor> results convert
/// back implicitly.
///
/// Every tensor operation — operators, methods, free functions, reductions, in-place ops —
/// runs its per-leaf work through runtime::run(), so the execution strategy (linear,
/// stream(M), automatic, fused) applies to all of them. Copying a TreeTensor copies the
/// structure and the tensor handles, never tensor data (use clone() for that).
///
/// Example:
///   TreeTensor t = randn({{"a", {2, 3}}, {"b", {{"x", {3, 4}}}}});
///   TreeTensor u = (t + 1).sigmoid();     // leaf-wise
///   at::Tensor m = mean(u);               // one value over every element of every leaf
///
/// Thread safety: like Tree<T> and at::Tensor — concurrent const use is safe; mutating a tree
/// (its structure or its leaves in place) while other threads use it is not.
class TreeTensor : public TensorTree {
 public:
  using TensorTree::TensorTree;
  TreeTensor() = default;
  /// Wraps a plain tree of tensors (e.g. the result of tree::map); no tensor data is copied.
  TreeTensor(TensorTree t) noexcept : TensorTree(std::move(t)) {}  // NOLINT
  TreeTensor(const TreeTensor&) = default;
  TreeTensor(TreeTensor&&) = default;
  // Lvalues only: `t["a"] = x` would assign to the copy operator[] returns and change nothing,
  // so it does not compile; replace a node through at() (`t.at("a") = x`).
  TreeTensor& operator=(const TreeTensor&) & = default;
  TreeTensor& operator=(TreeTensor&&) & = default;

  /// The subtree under `key` as a TreeTensor, so that the tensor API applies to it
  /// (`t["model"].sum()`, `t["enc"]["w"].leaf()`). It is a new tree that shares the leaves'
  /// tensors: in-place tensor ops on it (`t["enc"].mul_(2)`) change `t`'s tensors, but
  /// replacing a leaf or a key of it does not change `t` (use at(), which gives the node
  /// itself, a TensorTree&, for that). Copies the subtree's keys and tensor handles, never
  /// tensor data. @throws tree::KeyError as Tree::operator[] (naming the whole chain walked).
  TreeTensor operator[](std::string_view key) const;
  /// The leaf tensor (Tree::leaf()). On a temporary, such as `t["a"].leaf()` (operator[]
  /// returns a copy), the handle comes by value so that it outlives the copy; assigning to
  /// it (`t["a"].leaf() = x`) then copies x's values into the shared tensor, as ATen's
  /// `y.index(...) = x` does.
  const at::Tensor& leaf() const& { return TensorTree::leaf(); }
  at::Tensor& leaf() & { return TensorTree::leaf(); }
  at::Tensor leaf() && { return TensorTree::leaf(); }

  // ---- methods generated from the op registry (codegen/ops.toml; docs at the free functions
  // of the same names, ops_generated.hpp) ----------------------------------------------------
#include "treetensor/tensor/tree_tensor_ops.inc"  // NOLINT(build/include): inside the class

  // ---- hand-written methods (documented at the free function of the same name) ----------
  TreeTensor add(const Operand& other, const at::Scalar& alpha = 1) const;
  TreeTensor& add_(const Operand& other, const at::Scalar& alpha = 1);
  TreeTensor sub(const Operand& other, const at::Scalar& alpha = 1) const;
  TreeTensor& sub_(const Operand& other, const at::Scalar& alpha = 1);
  TreeTensor clamp(c10::optional<at::Scalar> min, c10::optional<at::Scalar> max = {}) const;
  TreeTensor& clamp_(c10::optional<at::Scalar> min, c10::optional<at::Scalar> max = {});
  TreeTensor& copy_(const Operand& src);
  TreeTensor& zero_();
  TreeTensor& fill_(const at::Scalar& value);
  TreeTensor& requires_grad_(bool requires_grad = true);
  TreeTensor isclose(const Operand& other, double rtol = 1e-5, double atol = 1e-8,
                     bool equal_nan = false) const;
  TreeTensor to(at::TensorOptions options, bool non_blocking = false, bool copy = false) const;
  TreeTensor to(at::ScalarType dtype) const;
  TreeTensor to(at::Device device) const;
  TreeTensor cpu() const;
  TreeTensor contiguous() const;
  TreeTensor reshape(at::IntArrayRef shape) const;
  TreeTensor view(at::IntArrayRef shape) const;
  TreeTensor squeeze() const;
  TreeTensor squeeze(int64_t dim) const;
  TreeTensor unsqueeze(int64_t dim) const;
  TreeTensor transpose(int64_t dim0, int64_t dim1) const;
  TreeTensor permute(at::IntArrayRef dims) const;
  TreeTensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  TreeTensor index_select(int64_t dim, const Operand& index) const;
  TreeTensor index(at::ArrayRef<at::indexing::TensorIndex> indices) const;
  TreeTensor index(const TensorTree& indices) const;
  std::vector<TreeTensor> split(int64_t split_size, int64_t dim = 0) const;
  std::vector<TreeTensor> chunk(int64_t chunks, int64_t dim = 0) const;

  /// Tree-level reductions: one tensor over every element of every leaf (DESIGN.md §4).
  at::Tensor sum() const;
  at::Tensor mean() const;
  at::Tensor all() const;
  at::Tensor any() const;
  at::Tensor min() const;
  at::Tensor max() const;
  at::Tensor std(bool unbiased = true) const;
  at::Tensor norm(double p = 2) const;

  // ---- attributes (trees of values; see single()) ----------------------------------------
  /// The tree of leaf shapes; it prints as torch.Size leaves (`├── a --> torch.Size([2, 3])`).
  tree::Tree<Size> shape() const;
  tree::Tree<at::ScalarType> dtype() const;
  tree::Tree<at::Device> device() const;
  tree::Tree<int64_t> numel() const;
  tree::Tree<bool> requires_grad() const;
  /// The tree of leaf gradients (`.grad()`); a leaf without a gradient holds an undefined tensor.
  TreeTensor grad() const;
  /// The leading dimension every leaf shares; see treetensor::batch_size().
  int64_t batch_size() const;

 private:
  struct ContinueTrail {};
  // Copies `node` and lets a chained operator[] on this copy continue the KeyError path.
  TreeTensor(const TensorTree& node, ContinueTrail);
};

/// Writes `t` in treetensor's layout: the header `<TreeTensor>`, one `key --> tensor(...)`
/// line per leaf (`├──`/`└──` glyphs, multi-line tensors indented under the arrow), tensors
/// formatted as PyTorch's repr does (4 decimals, `dtype=` when not the default, `grad_fn=` /
/// `requires_grad=True`, summarised with `...` above 1000 elements). A leaf root prints as the
/// tensor alone. Printing is the only place a tensor is ever formatted (DI-treetensor #19).
std::ostream& operator<<(std::ostream& os, const TreeTensor& t);

/// One tensor in PyTorch's repr form (`tensor([1., 2.])`), as used by operator<<.
std::string format_tensor(const at::Tensor& t);

namespace detail {
/// A leaf value for messages: streamed when T can be, ranges as `[2, 3]`.
template <class T>
std::string describe_value(const T& v) {
  std::ostringstream os;
  if constexpr (std::ranges::range<T> && !std::is_convertible_v<T, std::string_view>) {
    os << '[';
    const char* sep = "";
    for (const auto& x : v) os << std::exchange(sep, ", ") << describe_value(x);
    os << ']';
  } else {
    os << v;
  }
  return os.str();
}

inline constexpr std::size_t kListedOutliers = 8;

/// The majority-and-outliers message of single() and batch_size(): "7 of 9 leaves hold 4;
/// 'b' holds 3, 'c.x' holds 5" (at most 8 outliers listed). The majority is the most common
/// value; a tie goes to the one met first in flatten order.
template <class T>
std::string disagreement(const std::vector<const T*>& values,
                         const std::vector<tree::Path>& paths) {
  std::vector<std::pair<const T*, std::size_t>> counts;  // distinct values, first-seen order
  for (const T* v : values) {
    auto same = [&](const auto& c) { return *c.first == *v; };
    auto it = std::find_if(counts.begin(), counts.end(), same);
    if (it == counts.end())
      counts.emplace_back(v, 1);
    else
      ++it->second;
  }
  auto fewer = [](const auto& a, const auto& b) { return a.second < b.second; };
  const auto [majority, held] = *std::max_element(counts.begin(), counts.end(), fewer);
  std::string out = std::to_string(held) + " of " + std::to_string(values.size()) +
                    " leaves hold " + describe_value(*majority);
  std::size_t outliers = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (*values[i] == *majority) continue;
    if (++outliers <= kListedOutliers)
      out += (outliers == 1 ? "; '" : ", '") + paths[i].describe() + "' holds " +
             describe_value(*values[i]);
  }
  if (outliers > kListedOutliers)
    out += ", and " + std::to_string(outliers - kListedOutliers) + " more";
  return out;
}
}  // namespace detail

/// The single value of a tree of values when every leaf agrees (e.g.
/// `single(t.dtype()) == at::kFloat`, `single(t.shape())`).
/// @throws std::invalid_argument when the tree has no leaves, or when leaves disagree: the
///         message gives the majority value and every leaf that differs with its value,
///         e.g. "single: leaves disagree: 2 of 3 leaves hold Float; 'a' holds Double".
template <class T>
T single(const tree::Tree<T>& values) {
  const auto flat = tree::flatten_refs(values);
  if (flat.leaves.empty()) throw std::invalid_argument("single: the tree has no leaves");
  for (std::size_t i = 1; i < flat.leaves.size(); ++i)
    if (!(*flat.leaves[i] == *flat.leaves[0]))
      throw std::invalid_argument("single: leaves disagree: " +
                                  detail::disagreement(flat.leaves, flat.spec.paths()));
  return *flat.leaves[0];
}

/// The batch size: the size of the leading dimension (dim 0) that every leaf shares, as
/// tensordict's `batch_size` (its first entry) and DI-treetensor's habit of a shared batch dim.
/// @throws std::invalid_argument when the tree has no leaves, when a leaf is 0-d (named, with
///         "it has no leading dimension"), or when leaves disagree (the majority size and
///         every leaf that differs, with its size).
int64_t batch_size(const TensorTree& t);

}  // namespace treetensor
