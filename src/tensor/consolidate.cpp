// Consolidation: one buffer per (dtype, device) group (consolidate.hpp; DESIGN.md §12).
#include "treetensor/tensor/consolidate.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <stdexcept>

namespace treetensor {
namespace {

using Group = std::pair<at::ScalarType, at::Device>;

// Leaf i's element offset in its group's buffer, and each group's total elements.
struct Layout {
  std::vector<Group> groups;       // first-appearance order
  std::vector<std::size_t> group;  // per leaf
  std::vector<int64_t> offset;     // per leaf, elements
  std::vector<int64_t> total;      // per group, elements
};

Layout layout_of(const std::vector<const at::Tensor*>& leaves) {
  Layout l;
  for (const at::Tensor* x : leaves) {
    const Group key{x->scalar_type(), x->device()};
    const auto g = static_cast<std::size_t>(std::find(l.groups.begin(), l.groups.end(), key) -
                                            l.groups.begin());
    if (g == l.groups.size()) {  // a new group (there are few: a linear search)
      l.groups.push_back(key);
      l.total.push_back(0);
    }
    const int64_t align = std::max<int64_t>(1, kConsolidateAlignment / int64_t(x->element_size()));
    int64_t& end = l.total[g];
    end = (end + align - 1) / align * align;
    l.group.push_back(g);
    l.offset.push_back(end);
    end += x->numel();
  }
  return l;
}

std::vector<const at::Tensor*> defined_leaves(const TensorTree& t) {
  const auto flat = tree::flatten_refs(t);
  for (std::size_t i = 0; i < flat.leaves.size(); ++i)
    if (!flat.leaves[i]->defined())
      throw std::invalid_argument("consolidate: leaf '" + flat.spec.paths()[i].describe() +
                                  "' is undefined");
  return flat.leaves;
}

}  // namespace

bool is_consolidated(const TensorTree& t) {
  return !consolidated_groups(t).empty() || t.leaf_count() == 0;
}

std::vector<ConsolidatedGroup> consolidated_groups(const TensorTree& t) {
  const auto flat = tree::flatten_refs(t);
  for (const at::Tensor* x : flat.leaves)
    if (!x->defined() || !x->is_contiguous()) return {};
  const Layout l = layout_of(flat.leaves);
  std::vector<ConsolidatedGroup> out(l.groups.size());
  for (std::size_t i = 0; i < flat.leaves.size(); ++i) {
    const at::Tensor& x = *flat.leaves[i];
    ConsolidatedGroup& g = out[l.group[i]];
    if (!g.buffer.defined()) {
      const int64_t bytes = l.total[l.group[i]] * int64_t(x.element_size());
      if (int64_t(x.storage().nbytes()) != bytes) return {};
      g.buffer = at::empty({0}, x.options().requires_grad(false));
      g.buffer.set_(x.storage(), 0, {l.total[l.group[i]]}, {1});
    }
    if (!x.storage().is_alias_of(g.buffer.storage()) || x.storage_offset() != l.offset[i])
      return {};
    g.ranges.emplace_back(l.offset[i], x.numel());
  }
  return out;
}

TreeTensor consolidate(const TensorTree& t) {
  const auto leaves = defined_leaves(t);
  if (is_consolidated(t)) return TreeTensor(t);
  const Layout l = layout_of(leaves);
  std::vector<at::Tensor> buffers;
  for (std::size_t g = 0; g < l.groups.size(); ++g)
    buffers.push_back(at::zeros(
        {l.total[g]}, at::TensorOptions().dtype(l.groups[g].first).device(l.groups[g].second)));
  std::vector<at::Tensor> views;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const at::Tensor& x = *leaves[i];
    at::Tensor v = buffers[l.group[i]].narrow(0, l.offset[i], x.numel()).view(x.sizes());
    {
      at::NoGradGuard no_grad;
      v.copy_(x);
    }
    v = v.detach();  // a fresh leaf: no history, so later in-place updates are allowed
    if (x.requires_grad()) v.requires_grad_(true);
    views.push_back(std::move(v));
  }
  return tree::unflatten(tree::flatten_refs(t).spec, views);
}

}  // namespace treetensor
