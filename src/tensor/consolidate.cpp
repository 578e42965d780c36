// Consolidation: one buffer per (dtype, device) group, carried as a property of the tree value
// (consolidate.hpp; DESIGN.md §12).
#include "treetensor/tensor/consolidate.hpp"

#include "runtime/fork.hpp"
#include "tensor/leafwise.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

namespace treetensor {
namespace {

using Group = std::pair<at::ScalarType, at::Device>;

// Group ids in order of first appearance of each (dtype, device).
std::vector<std::size_t> group_ids(const std::vector<const at::Tensor*>& leaves,
                                   std::vector<Group>& groups) {
  std::vector<std::size_t> ids;
  ids.reserve(leaves.size());
  for (const at::Tensor* x : leaves) {
    const Group key{x->scalar_type(), x->device()};
    auto it = std::find(groups.begin(), groups.end(), key);  // few groups: a linear search
    if (it == groups.end()) it = groups.insert(groups.end(), key);
    ids.push_back(static_cast<std::size_t>(it - groups.begin()));
  }
  return ids;
}

// One shared layout per distinct layout in use, so that trees consolidated separately (a model's
// parameters and its gradients) compare equal by pointer in a flat call, not leaf by leaf.
class LayoutRegistry {
 public:
  // Held over fork() (DESIGN.md §10): consolidate() on another thread must not leave a child
  // with it locked. The registry is never destroyed.
  LayoutRegistry() { runtime::detail::hold_over_fork(mutex_); }

  std::shared_ptr<const ConsolidatedLayout> intern(std::shared_ptr<const ConsolidatedLayout> l) {
    const std::size_t h = l->hash();
    std::lock_guard<std::mutex> lock(mutex_);
    auto [lo, hi] = layouts_.equal_range(h);
    for (auto it = lo; it != hi; ++it)
      if (auto known = it->second.lock(); known && *known == *l) return known;
    if (++inserts_ % 64 == 0)
      std::erase_if(layouts_, [](const auto& e) { return e.second.expired(); });
    layouts_.emplace(h, l);
    return l;
  }

 private:
  std::mutex mutex_;
  std::unordered_multimap<std::size_t, std::weak_ptr<const ConsolidatedLayout>> layouts_;
  std::size_t inserts_ = 0;
};

LayoutRegistry& registry() {
  static auto* r = new LayoutRegistry();  // leaked: layouts may die during static destruction
  return *r;
}

// The storages that hold (or held) a consolidated tree's buffer. Their padding belongs to no
// tensor outside consolidated trees, so consolidate() may take them back without a copy. The
// weak references keep a dead StorageImpl's address from being reused while it is listed.
class BufferRegistry {
 public:
  void add(const at::Tensor& buffer) {
    if (!buffer.has_storage()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (++adds_ % 256 == 0) std::erase_if(known_, [](const auto& e) { return e.second.expired(); });
    known_.insert_or_assign(buffer.storage().unsafeGetStorageImpl(),
                            buffer.storage().getWeakStorageImpl());
  }
  bool contains(const c10::Storage& s) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = known_.find(s.unsafeGetStorageImpl());
    return it != known_.end() && !it->second.expired();
  }

 private:
  std::mutex mutex_;
  std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> known_;
  std::size_t adds_ = 0;
};

BufferRegistry& buffer_registry() {
  static auto* r = new BufferRegistry();  // leaked, as the layouts
  return *r;
}

std::shared_ptr<const ConsolidatedLayout> layout_of(const tree::TreeSpec& spec,
                                                    const std::vector<const at::Tensor*>& leaves,
                                                    std::vector<Group>& groups) {
  const auto ids = group_ids(leaves, groups);
  std::vector<at::IntArrayRef> sizes;
  std::vector<int64_t> item;
  for (const at::Tensor* x : leaves) {
    sizes.push_back(x->sizes());
    item.push_back(static_cast<int64_t>(x->element_size()));
  }
  return registry().intern(std::make_shared<const ConsolidatedLayout>(spec, ids, sizes, item));
}

std::vector<const at::Tensor*> defined_leaves(const tree::Flat<const at::Tensor*>& flat) {
  for (std::size_t i = 0; i < flat.leaves.size(); ++i)
    if (!flat.leaves[i]->defined())
      throw std::invalid_argument("consolidate: leaf '" + flat.spec.paths()[i].describe() +
                                  "' is undefined");
  return flat.leaves;
}

std::vector<int64_t> row_major_strides(at::IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t s = 1;
  for (std::size_t d = sizes.size(); d-- > 0;) {
    strides[d] = s;
    s *= std::max<int64_t>(sizes[d], 1);
  }
  return strides;
}

// The buffers the leaves already lie in as `layout` places them, or empty (O(leaves)).
// Flat calls write a buffer's padding, which in someone else's storage (a tensor the leaves
// were sliced from, a leaf of another group viewing it as another dtype) would be that
// tensor's data: only storage that held a consolidated tree's buffer is taken, one per group.
std::vector<at::Tensor> buffers_in_place(const ConsolidatedLayout& layout,
                                         const std::vector<const at::Tensor*>& leaves) {
  std::vector<at::Tensor> buffers(layout.groups());
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const at::Tensor& x = *leaves[i];
    // A conjugate or negative view reads its storage through its bit: not the buffer's values.
    if (!x.defined() || !x.is_contiguous() || !x.has_storage() || x.is_conj() || x.is_neg())
      return {};
    at::Tensor& b = buffers[layout.group(i)];
    if (!b.defined()) {
      const int64_t numel = layout.group_numel(layout.group(i));
      if (int64_t(x.storage().nbytes()) != numel * int64_t(x.element_size()) ||
          !buffer_registry().contains(x.storage()))
        return {};
      for (const at::Tensor& other : buffers)
        if (other.defined() && other.storage().is_alias_of(x.storage())) return {};
      b = at::empty({0}, x.options().requires_grad(false));
      b.set_(x.storage(), 0, {numel}, {1});
    }
    if (!x.storage().is_alias_of(b.storage()) || x.storage_offset() != layout.offset(i)) return {};
  }
  return buffers;
}

}  // namespace

// ---- ConsolidatedTree ----------------------------------------------------------------------

ConsolidatedTree::ConsolidatedTree(std::shared_ptr<const ConsolidatedLayout> layout,
                                   std::vector<at::Tensor> buffers)
    : layout_(std::move(layout)), buffers_(std::move(buffers)) {
  for (const at::Tensor& b : buffers_) buffer_registry().add(b);
}

// ---- ConsolidatedLayout --------------------------------------------------------------------

ConsolidatedLayout::ConsolidatedLayout(tree::TreeSpec spec, const std::vector<std::size_t>& group,
                                       const std::vector<at::IntArrayRef>& sizes,
                                       const std::vector<int64_t>& element_size)
    : spec_(std::move(spec)), group_(group) {
  const std::size_t n = group.size();
  offset_.reserve(n);
  numel_.reserve(n);
  dims_begin_.reserve(n + 1);
  for (std::size_t i = 0; i < n; ++i) {
    if (group[i] >= group_numel_.size()) group_numel_.resize(group[i] + 1, 0);
    const int64_t align = std::max<int64_t>(1, kConsolidateAlignment / element_size[i]);
    int64_t& end = group_numel_[group[i]];
    const int64_t start = (end + align - 1) / align * align;
    dense_ = dense_ && start == end;
    int64_t numel = 1;
    for (int64_t s : sizes[i]) numel *= s;
    has_scalar_leaf_ = has_scalar_leaf_ || sizes[i].empty();
    offset_.push_back(start);
    numel_.push_back(numel);
    dims_begin_.push_back(sizes_.size());
    sizes_.insert(sizes_.end(), sizes[i].begin(), sizes[i].end());
    end = start + numel;
    total_numel_ += numel;
  }
  dims_begin_.push_back(sizes_.size());
  masks_.resize(group_numel_.size());
}

at::IntArrayRef ConsolidatedLayout::sizes(std::size_t leaf) const {
  return at::IntArrayRef(sizes_.data() + dims_begin_[leaf],
                         dims_begin_[leaf + 1] - dims_begin_[leaf]);
}

at::Tensor ConsolidatedLayout::mask(std::size_t g, at::Device device) const {
  std::lock_guard<std::mutex> lock(mask_mutex_);
  if (!masks_[g].defined()) {
    at::Tensor m = at::zeros({group_numel_[g]}, at::kBool);
    auto* p = m.data_ptr<bool>();
    for (std::size_t i = 0; i < group_.size(); ++i)
      if (group_[i] == g) std::memset(p + offset_[i], 1, static_cast<std::size_t>(numel_[i]));
    masks_[g] = std::move(m);
  }
  return masks_[g].to(device);
}

std::size_t ConsolidatedLayout::hash() const noexcept {
  std::size_t h = spec_.hash();
  auto mix = [&h](std::size_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
  for (std::size_t i = 0; i < offset_.size(); ++i) mix(std::size_t(offset_[i]) * 31 + group_[i]);
  for (int64_t s : sizes_) mix(std::size_t(s));
  return h;
}

bool operator==(const ConsolidatedLayout& a, const ConsolidatedLayout& b) {
  return &a == &b || (a.group_ == b.group_ && a.offset_ == b.offset_ && a.sizes_ == b.sizes_ &&
                      a.dims_begin_ == b.dims_begin_ && a.spec_ == b.spec_);
}

// ---- ConsolidatedTree ------------------------------------------------------------------------

at::Tensor ConsolidatedTree::leaf_view(std::size_t leaf) const {
  const at::Tensor& b = buffers_[layout_->group(leaf)];
  const at::IntArrayRef sizes = layout_->sizes(leaf);
  // detach(): a leaf is a tensor of its own to autograd (as consolidate() has always made
  // them), not a view of the buffer, so that detach_() and requires_grad_() work on it; it
  // still shares the buffer's version counter.
  return b.as_strided(sizes, row_major_strides(sizes), b.storage_offset() + layout_->offset(leaf))
      .detach();
}

TensorTree ConsolidatedTree::make() const {
  std::vector<at::Tensor> leaves;
  leaves.reserve(layout_->leaves());
  for (std::size_t i = 0; i < layout_->leaves(); ++i) leaves.push_back(leaf_view(i));
  return tree::unflatten(layout_->spec(), std::move(leaves));
}

bool ConsolidatedTree::describes(const TensorTree& t) const {
  std::size_t i = 0;
  const bool all = detail::all_leaves(t, [&](const at::Tensor& x) {
    if (i >= layout_->leaves() || !x.defined() || !x.has_storage() || x.is_conj() || x.is_neg())
      return false;
    const at::Tensor& b = buffers_[layout_->group(i)];
    const bool same = x.scalar_type() == b.scalar_type() && x.device() == b.device() &&
                      x.unsafeGetTensorImpl()->unsafe_storage().is_alias_of(b.storage()) &&
                      x.storage_offset() == b.storage_offset() + layout_->offset(i) &&
                      x.sizes() == layout_->sizes(i) && x.is_contiguous();
    ++i;
    return same;
  });
  return all && i == layout_->leaves();
}

const ConsolidatedTree* consolidated_source(const TensorTree& t) {
  const auto* c = dynamic_cast<const ConsolidatedTree*>(t.source());
  if (c == nullptr || t.is_deferred()) return c;
  return c->describes(t) ? c : nullptr;
}

TreeTensor consolidated_tree(std::shared_ptr<const ConsolidatedLayout> layout,
                             std::vector<at::Tensor> buffers) {
  return TensorTree::deferred(
      std::make_shared<const ConsolidatedTree>(std::move(layout), std::move(buffers)));
}

// ---- consolidate ---------------------------------------------------------------------------

bool is_consolidated(const TensorTree& t) {
  return consolidated_source(t) != nullptr || t.empty();
}

namespace {
std::vector<ConsolidatedGroup> groups_of(const ConsolidatedTree& c) {
  const ConsolidatedLayout& l = c.layout();
  std::vector<ConsolidatedGroup> out(l.groups());
  for (std::size_t g = 0; g < l.groups(); ++g) out[g].buffer = c.buffers()[g];
  for (std::size_t i = 0; i < l.leaves(); ++i)
    out[l.group(i)].ranges.emplace_back(l.offset(i), l.numel(i));
  return out;
}
}  // namespace

std::vector<ConsolidatedGroup> consolidated_groups(const TensorTree& t) {
  if (const ConsolidatedTree* c = consolidated_source(t)) return groups_of(*c);
  const auto flat = tree::flatten_refs(t);
  for (const at::Tensor* x : flat.leaves)
    if (!x->defined()) return {};
  std::vector<Group> groups;
  auto layout = layout_of(flat.spec, flat.leaves, groups);
  auto buffers = buffers_in_place(*layout, flat.leaves);
  if (buffers.empty()) return {};
  return groups_of(ConsolidatedTree(std::move(layout), std::move(buffers)));
}

TreeTensor consolidate(const TensorTree& t) {
  if (consolidated_source(t)) return TreeTensor(t);
  const auto flat = tree::flatten_refs(t);
  const auto leaves = defined_leaves(flat);
  std::vector<Group> groups;
  auto layout = layout_of(flat.spec, leaves, groups);
  if (auto in_place = buffers_in_place(*layout, leaves); !in_place.empty() || leaves.empty())
    return TensorTree::tagged(
        t, std::make_shared<const ConsolidatedTree>(std::move(layout), std::move(in_place)));
  std::vector<at::Tensor> buffers;
  for (std::size_t g = 0; g < groups.size(); ++g)
    buffers.push_back(
        at::zeros({layout->group_numel(g)},
                  at::TensorOptions().dtype(groups[g].first).device(groups[g].second)));
  auto source = std::make_shared<const ConsolidatedTree>(std::move(layout), std::move(buffers));
  bool grad = false;
  {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < leaves.size(); ++i) {
      source->leaf_view(i).copy_(*leaves[i]);
      grad = grad || leaves[i]->requires_grad();
    }
  }
  // Without autograd the leaves are made on first access, like a flat result's.
  if (!grad) return TensorTree::deferred(std::move(source));
  // Autograd leaves must be fresh leaves (no history, so later in-place updates are allowed)
  // that every copy of the tree shares: made now.
  std::vector<at::Tensor> views;
  views.reserve(leaves.size());
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    at::Tensor v = source->leaf_view(i);
    if (leaves[i]->requires_grad()) v.requires_grad_(true);
    views.push_back(std::move(v));
  }
  return TensorTree::tagged(tree::unflatten(flat.spec, std::move(views)), std::move(source));
}

}  // namespace treetensor
