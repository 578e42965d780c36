// The compiled core of every tree-tensor op: zip the tree arguments in one walk, run the leaf
// jobs through runtime::run(), build the result tree in place.
//
// Hot path (a strict zip of trees with equal structure): one lockstep walk over all trees that
// compares keys and, in the same pass, builds the result's structure with empty leaf slots
// (children vectors reserved up front, so slot addresses stay stable), collecting one row of
// operand pointers per leaf. No TreeSpec, no per-leaf path string, no tensor handle copies; the
// leaf path is only computed when an error needs it.
#include "treetensor/tensor/dispatch.hpp"

#include <ATen/ScalarOps.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <iterator>
#include <stdexcept>
#include <string>

#include "treetensor/asyncs/operands.hpp"
#include "treetensor/runtime/errors.hpp"
#include "treetensor/runtime/stream.hpp"
#include "treetensor/tree/internal_error.hpp"
#include "treetensor/tree/zip_rules.hpp"

#include "tensor/flat.hpp"

namespace treetensor::detail {
namespace {

using Children = TensorTree::Children;

bool same_keys(const Children& a, const Children& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].first != b[i].first) return false;
  return true;
}

std::vector<std::string> keys_of(const Children& c) {
  std::vector<std::string> out;
  out.reserve(c.size());
  for (const auto& e : c) out.push_back(e.first);
  return out;
}

// One call's zip: the operand rows of every leaf and, when building, the result's leaf slots.
class Zip {
 public:
  Zip(const CallOptions& o, c10::ArrayRef<Operand> args)
      : o_(o), args_(args), names_{o.op, o.arg_names.data(), o.arg_names.size()} {
    base_row_.resize(args.size(), &undefined_);
    if (o.wrap_scalars) wrapped_.resize(args.size());
    for (std::size_t k = 0; k < args.size(); ++k) {
      switch (args[k].kind()) {
        case Operand::Kind::tree:
          tree_args_.push_back(k);
          break;
        case Operand::Kind::tensor:
          base_row_[k] = &args[k].tensor();
          break;
        case Operand::Kind::scalar:
          if (o.wrap_scalars) {
            wrapped_[k] = at::native::wrapped_scalar_tensor(args[k].scalar());
            base_row_[k] = &wrapped_[k];
          }
          break;
      }
    }
    if (tree_args_.empty())
      throw std::invalid_argument(std::string(o.op) +
                                  ": needs at least one tree argument (got only tensors/scalars)");
  }

  // Walks the trees, filling rows() and, when `out` is given, building its structure.
  void run(TensorTree* out) {
    c10::SmallVector<const TensorTree*, 4> cur;
    for (std::size_t k : tree_args_) cur.push_back(&args_[k].tree());
    node(cur, out);
  }

  std::size_t leaves() const noexcept { return args_.empty() ? 0 : rows_.size() / args_.size(); }
  const at::Tensor* const* row(std::size_t i) const noexcept {
    return rows_.data() + i * args_.size();
  }
  const std::vector<at::Tensor*>& slots() const noexcept { return slots_; }
  const std::vector<std::size_t>& tree_args() const noexcept { return tree_args_; }

  // Every leaf's tensor operand k, for the fused form and operand tracking.
  std::vector<at::Tensor> column(std::size_t k) const {
    std::vector<at::Tensor> col;
    col.reserve(leaves());
    for (std::size_t i = 0; i < leaves(); ++i) col.push_back(*row(i)[k]);
    return col;
  }

  // Device and dtype of the first leaf of the first tree argument (policy input).
  void describe(runtime::LeafCall& call) const {
    if (leaves() == 0) return;
    const at::Tensor& t = *row(0)[tree_args_.front()];
    if (!t.defined()) return;
    call.device = t.device();
    call.dtype = t.scalar_type();
  }

  runtime::LeafCost default_cost(std::size_t i) const {
    double read = 0, largest = 0;
    for (std::size_t k : tree_args_) {
      const at::Tensor& t = *row(i)[k];
      if (!t.defined()) continue;
      const double b = static_cast<double>(t.numel()) * static_cast<double>(t.element_size());
      read += b;
      largest = std::max(largest, b);
    }
    return {read / 4, read + largest};  // about one op per element read
  }

 private:
  using Cursors = c10::SmallVector<const TensorTree*, 4>;

  void node(const Cursors& cur, TensorTree* out) {
    std::size_t internal = 0, leaf_args = 0, first = 0;
    for (std::size_t j = 0; j < cur.size(); ++j) {
      if (!cur[j]) continue;
      if (cur[j]->is_leaf()) {
        ++leaf_args;
      } else if (internal++ == 0) {
        first = j;
      }
    }
    if (internal == 0) return leaf(cur, out);
    if (leaf_args && !o_.zip.inherit) leaf_faces_subtree(cur);
    const Children& ref = cur[first]->children();
    bool same = true;
    for (std::size_t j = 0; j < cur.size() && same; ++j)
      if (cur[j] && !cur[j]->is_leaf() && j != first) same = same_keys(cur[j]->children(), ref);
    if (same) return lockstep(cur, ref, out);
    merged(cur, out);
  }

  void leaf(const Cursors& cur, TensorTree* out) {
    const std::size_t base = rows_.size();
    rows_.insert(rows_.end(), base_row_.begin(), base_row_.end());
    for (std::size_t j = 0; j < cur.size(); ++j) {
      if (cur[j]) {
        rows_[base + tree_args_[j]] = &cur[j]->leaf();
      } else if (o_.missing) {
        rows_[base + tree_args_[j]] = o_.missing;
      } else {
        tree::detail::throw_no_leaf(trail_, tree_args_[j], names_);
      }
    }
    if (out) {
      *out = TensorTree(at::Tensor());
      slots_.push_back(&out->leaf());
    }
  }

  // Equal key lists: children are matched by index, no lookups.
  void lockstep(const Cursors& cur, const Children& ref, TensorTree* out) {
    Children* oc = out ? &out->children() : nullptr;
    if (oc) oc->reserve(ref.size());
    Cursors next(cur.size());
    for (std::size_t c = 0; c < ref.size(); ++c) {
      for (std::size_t j = 0; j < cur.size(); ++j)
        next[j] = !cur[j] || cur[j]->is_leaf() ? cur[j] : &cur[j]->children()[c].second;
      trail_.push_back(&ref[c].first);
      TensorTree* child = nullptr;
      if (oc) child = &oc->emplace_back(ref[c].first, TensorTree()).second;
      node(next, child);
      trail_.pop_back();
    }
  }

  // Differing key lists: the tree layer's rules decide (tree/zip_rules.hpp).
  void merged(const Cursors& cur, TensorTree* out) {
    tree::detail::KeySets sets;
    for (std::size_t j = 0; j < cur.size(); ++j)
      if (cur[j] && !cur[j]->is_leaf()) {
        sets.keys.push_back(keys_of(cur[j]->children()));
        sets.positions.push_back(tree_args_[j]);
      }
    const std::vector<std::string> keys =
        tree::detail::merge_keys(sets, o_.zip.mode, o_.missing != nullptr, trail_, names_);
    Children* oc = out ? &out->children() : nullptr;
    if (oc) oc->reserve(keys.size());
    Cursors next(cur.size());
    for (const std::string& key : keys) {
      for (std::size_t j = 0; j < cur.size(); ++j)
        next[j] = !cur[j] || cur[j]->is_leaf() ? cur[j] : cur[j]->find(Path{key});
      trail_.push_back(&key);
      TensorTree* child = nullptr;
      if (oc) child = &oc->emplace_back(key, TensorTree()).second;
      node(next, child);
      trail_.pop_back();
    }
  }

  [[noreturn]] void leaf_faces_subtree(const Cursors& cur) const {
    std::size_t leaf_pos = 0, tree_pos = 0;
    bool seen_leaf = false, seen_tree = false;
    std::vector<std::string> keys;
    for (std::size_t j = 0; j < cur.size(); ++j) {
      if (!cur[j]) continue;
      if (cur[j]->is_leaf() && !seen_leaf) seen_leaf = true, leaf_pos = tree_args_[j];
      if (!cur[j]->is_leaf() && !seen_tree) {
        seen_tree = true, tree_pos = tree_args_[j];
        keys = keys_of(cur[j]->children());
      }
    }
    tree::detail::throw_leaf_faces_subtree(trail_, leaf_pos, tree_pos, keys, names_);
  }

  const CallOptions& o_;
  c10::ArrayRef<Operand> args_;
  tree::detail::ZipNames names_;
  at::Tensor undefined_;
  std::vector<at::Tensor> wrapped_;
  std::vector<std::size_t> tree_args_;
  std::vector<const at::Tensor*> base_row_;
  std::vector<const at::Tensor*> rows_;
  std::vector<at::Tensor*> slots_;
  tree::detail::Trail trail_;
};

// "{a, x.c}" from dotted paths (tree::format_keys would quote the dots as part of one key).
std::string join_paths(const std::vector<std::string>& paths) {
  std::string out = "{";
  for (std::size_t i = 0; i < paths.size(); ++i) out += (i ? ", " : "") + paths[i];
  return out + "}";
}

// Leaf i's dotted path in a tree whose flatten order is the call's leaf order.
std::string label_of(const TensorTree& t, std::size_t i) {
  const auto paths = t.paths();
  TREETENSOR_INTERNAL_ASSERT(i < paths.size(),
                             "leaf " + std::to_string(i) + " of " + std::to_string(paths.size()));
  return paths[i].describe();
}

// Operand tracking (asyncs, DESIGN.md §10): wait for pending work before touching the leaves.
// The first `written` arguments are written (in-place calls), the rest read.
void await_tracked(const Zip& z, c10::ArrayRef<Operand> args, std::size_t written) {
  if (!asyncs::tracking_active()) return;
  std::vector<at::Tensor> reads, writes;
  for (std::size_t k = 0; k < args.size(); ++k) {
    if (args[k].kind() == Operand::Kind::tensor) reads.push_back(args[k].tensor());
    if (!args[k].is_tree()) continue;
    auto col = z.column(k);
    auto& dst = k < written ? writes : reads;
    dst.insert(dst.end(), std::make_move_iterator(col.begin()), std::make_move_iterator(col.end()));
  }
  asyncs::await_operands(reads, writes);
}

// Every leaf passes o.check before any is updated, so a mismatch leaves the trees untouched.
void check_leaves(const CallOptions& o, const Zip& z, c10::ArrayRef<Operand> args,
                  const TensorTree& target) {
  if (!o.check) return;
  for (std::size_t i = 0; i < z.leaves(); ++i) {
    const std::string problem = o.check(LeafArgs(z.row(i), args.data(), i));
    if (!problem.empty())
      throw std::invalid_argument(std::string(o.op) + ": at '" + label_of(target, i) +
                                  "': " + problem);
  }
}

std::vector<std::vector<at::Tensor>> columns_of(const Zip& z, std::size_t n) {
  std::vector<std::vector<at::Tensor>> cols;
  cols.reserve(n);
  for (std::size_t k = 0; k < n; ++k) cols.push_back(z.column(k));
  return cols;
}

// ---- in-place aliasing ----------------------------------------------------------------------
// An in-place call whose leaves share memory (tied weights: one tensor at two paths; a leaf
// updated from another leaf's tensor) must update them in flatten order, one after another,
// as the native loop does; otherwise lanes would race and values would depend on the strategy.

// The byte range a tensor's elements occupy ([lo, hi); empty for no elements).
std::pair<std::uintptr_t, std::uintptr_t> extent(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0 || !t.has_storage()) return {0, 0};
  std::int64_t lo = 0, hi = 0;
  for (std::int64_t d = 0; d < t.dim(); ++d) {
    const std::int64_t span = t.stride(d) * (t.size(d) - 1);
    (span < 0 ? lo : hi) += span;
  }
  const auto base = reinterpret_cast<std::uintptr_t>(t.data_ptr());
  const auto item = static_cast<std::int64_t>(t.element_size());
  return {base + static_cast<std::uintptr_t>(lo * item),
          base + static_cast<std::uintptr_t>((hi + 1) * item)};
}

struct Touch {
  const void* storage;  // tensors of different storages never overlap
  std::size_t leaf;     // kAllLeaves for a broadcast tensor (read by every leaf)
  bool write;
  const at::Tensor* tensor;
};
constexpr std::size_t kAllLeaves = SIZE_MAX;

std::size_t find_root(std::vector<std::size_t>& parent, std::size_t i) {
  while (parent[i] != i) i = parent[i] = parent[parent[i]];
  return i;
}

// Groups of leaves that must run in order on one thread; empty when every leaf is independent
// (the common case: one storage sort and no further work).
std::vector<std::vector<std::size_t>> conflict_groups(const Zip& z, c10::ArrayRef<Operand> args,
                                                      std::size_t written) {
  const std::size_t leaves = z.leaves();
  std::vector<Touch> touches;
  touches.reserve(leaves * args.size());
  for (std::size_t k = 0; k < args.size(); ++k) {
    if (args[k].kind() == Operand::Kind::scalar) continue;
    for (std::size_t i = 0; i < (args[k].is_tree() ? leaves : 1); ++i) {
      const at::Tensor& t = args[k].is_tree() ? *z.row(i)[k] : args[k].tensor();
      if (!t.defined() || !t.has_storage()) continue;
      touches.push_back({t.storage().unsafeGetStorageImpl(), args[k].is_tree() ? i : kAllLeaves,
                         k < written, &t});
    }
  }
  std::sort(touches.begin(), touches.end(),
            [](const Touch& a, const Touch& b) { return a.storage < b.storage; });
  std::vector<std::size_t> parent;
  bool all = false;
  for (std::size_t b = 0; b < touches.size();) {
    std::size_t e = b + 1;
    while (e < touches.size() && touches[e].storage == touches[b].storage) ++e;
    for (std::size_t i = b; i < e; ++i)
      for (std::size_t j = i + 1; j < e; ++j) {
        const Touch &x = touches[i], &y = touches[j];
        if (x.leaf == y.leaf || !(x.write || y.write)) continue;
        const auto ex = extent(*x.tensor), ey = extent(*y.tensor);
        if (ex.first >= ey.second || ey.first >= ex.second) continue;  // disjoint views
        if (x.leaf == kAllLeaves || y.leaf == kAllLeaves) {
          all = true;
          continue;
        }
        if (parent.empty()) {
          parent.resize(leaves);
          for (std::size_t l = 0; l < leaves; ++l) parent[l] = l;
        }
        parent[find_root(parent, x.leaf)] = find_root(parent, y.leaf);
      }
    b = e;
  }
  std::vector<std::vector<std::size_t>> groups;
  if (all) {
    groups.emplace_back(leaves);
    for (std::size_t l = 0; l < leaves; ++l) groups[0][l] = l;
    return groups;
  }
  if (parent.empty()) return groups;
  std::vector<std::size_t> slot(leaves, SIZE_MAX);
  for (std::size_t l = 0; l < leaves; ++l) {  // groups ordered by their first leaf
    const std::size_t r = find_root(parent, l);
    if (slot[r] == SIZE_MAX) slot[r] = groups.size(), groups.emplace_back();
    groups[slot[r]].push_back(l);
  }
  return groups;
}

// Whether the leaf jobs of this call may run concurrently (not linear, not inline).
bool may_run_concurrently() {
  return !(runtime::current_stream_mode() == runtime::StreamMode{});
}

}  // namespace

bool FusedArgs::foreach_compatible() const {
  const at::Tensor* first = nullptr;  // every tensor must match its dtype and device
  const bool grad = at::GradMode::is_enabled();
  for (std::size_t k = 0; k < ops_.size(); ++k) {
    if (ops_[k].kind() == Operand::Kind::tensor) return false;
    if (!ops_[k].is_tree()) continue;
    for (std::size_t i = 0; i < columns_[k].size(); ++i) {
      const at::Tensor& t = columns_[k][i];
      if (!t.defined() || !at::isFloatingType(t.scalar_type()) || (grad && t.requires_grad()))
        return false;
      if (!first) first = &t;
      if (t.scalar_type() != first->scalar_type() || t.device() != first->device()) return false;
      for (std::size_t j = 0; j < k; ++j)
        if (ops_[j].is_tree() && !columns_[j][i].sizes().equals(t.sizes())) return false;
    }
  }
  return true;
}

TreeTensor map_leaves(const CallOptions& o, c10::ArrayRef<Operand> args, LeafFn f, FusedFn fused) {
  if (o.elementwise)
    if (auto flat = flat_map(o, args, f)) return std::move(*flat);
  Zip z(o, args);
  TreeTensor result;
  z.run(&result);
  await_tracked(z, args, 0);
  const std::size_t n = args.size();
  const auto& slots = z.slots();
  auto run = [&](std::size_t i) { *slots[i] = f(LeafArgs(z.row(i), args.data(), i)); };
  auto label = [&](std::size_t i) { return label_of(result, i); };
  auto cost = [&](std::size_t i) {
    return o.cost ? o.cost(LeafArgs(z.row(i), args.data(), i)) : z.default_cost(i);
  };
  auto batched = [&]() -> bool {
    FusedArgs fa(args, columns_of(z, n));
    std::vector<at::Tensor> out;
    if (!fused(fa, out)) return false;
    TORCH_INTERNAL_ASSERT(out.size() == slots.size(), o.op, ": fused form returned ", out.size(),
                          " results for ", slots.size(), " leaves");
    for (std::size_t i = 0; i < slots.size(); ++i) *slots[i] = std::move(out[i]);
    return true;
  };
  runtime::LeafCall call{o.op, slots.size(), run, label, cost};
  if (fused) call.fused = batched;
  z.describe(call);
  runtime::run(call);
  return result;
}

std::vector<TreeTensor> map_leaves_multi(const CallOptions& o, c10::ArrayRef<Operand> args,
                                         LeafFnMulti f) {
  Zip z(o, args);
  TreeTensor skeleton;
  z.run(&skeleton);
  await_tracked(z, args, 0);
  const std::size_t leaves = z.leaves();
  std::vector<std::vector<at::Tensor>> results(leaves);
  auto run = [&](std::size_t i) { results[i] = f(LeafArgs(z.row(i), args.data(), i)); };
  auto label = [&](std::size_t i) { return label_of(skeleton, i); };
  auto cost = [&](std::size_t i) {
    return o.cost ? o.cost(LeafArgs(z.row(i), args.data(), i)) : z.default_cost(i);
  };
  runtime::LeafCall call{o.op, leaves, run, label, cost};
  z.describe(call);
  runtime::run(call);

  const std::size_t count = leaves ? results[0].size() : 0;
  for (std::size_t i = 1; i < leaves; ++i)
    if (results[i].size() != count) {
      const Path p = skeleton.paths()[i];
      throw tree::StructureError(p, std::string(o.op) + ": leaf '" + p.describe() + "' gave " +
                                        std::to_string(results[i].size()) + " results but leaf '" +
                                        skeleton.paths()[0].describe() + "' gave " +
                                        std::to_string(count));
    }
  std::vector<TreeTensor> out(count, skeleton);
  for (std::size_t k = 0; k < count; ++k) {
    auto flat = tree::flatten_mut(static_cast<TensorTree&>(out[k]));
    for (std::size_t i = 0; i < leaves; ++i) *flat.leaves[i] = std::move(results[i][k]);
  }
  return out;
}

void update_leaves(const CallOptions& o, c10::ArrayRef<Operand> args, LeafUpdate f,
                   FusedUpdate fused) {
  if (args.empty() || !args[0].is_tree())
    throw std::invalid_argument(std::string(o.op) + ": the first argument must be a tree");
  if (o.elementwise && flat_update(o, args, f)) return;
  CallOptions strict = o;  // an in-place target keeps its own structure
  strict.zip = ZipOptions{};
  strict.missing = nullptr;
  Zip z(strict, args);
  z.run(nullptr);
  const TensorTree& target = args[0].tree();
  check_leaves(o, z, args, target);
  await_tracked(z, args, o.written);
  const std::size_t leaves = z.leaves(), n = args.size();
  std::vector<std::uint8_t> done(leaves, 0);
  bool fused_ran = false;
  auto run = [&](std::size_t i) {
    f(LeafArgs(z.row(i), args.data(), i));
    done[i] = 1;
  };
  auto label = [&](std::size_t i) { return label_of(target, i); };
  auto cost = [&](std::size_t i) {
    return o.cost ? o.cost(LeafArgs(z.row(i), args.data(), i)) : z.default_cost(i);
  };
  auto batched = [&]() -> bool {
    FusedArgs fa(args, columns_of(z, n));
    fused_ran = true;
    if (!fused(fa)) return fused_ran = false;
    std::fill(done.begin(), done.end(), 1);
    return true;
  };
  // Leaves that share memory run as one job each group, in flatten order, and never fused.
  const auto groups = may_run_concurrently() ? conflict_groups(z, args, o.written)
                                             : std::vector<std::vector<std::size_t>>{};
  std::vector<std::size_t> failed(groups.size(), SIZE_MAX);
  auto run_group = [&](std::size_t g) {
    std::exception_ptr first;
    for (std::size_t i : groups[g]) {
      try {
        run(i);
      } catch (...) {
        if (!first) first = std::current_exception(), failed[g] = i;
      }
    }
    if (first) std::rethrow_exception(first);
  };
  auto label_group = [&](std::size_t g) {
    return label_of(target, failed[g] != SIZE_MAX ? failed[g] : groups[g].front());
  };
  auto cost_group = [&](std::size_t g) {
    runtime::LeafCost c;
    for (std::size_t i : groups[g]) c.flops += cost(i).flops, c.bytes += cost(i).bytes;
    return c;
  };
  runtime::LeafCall call{o.op, leaves, run, label, cost};
  if (groups.empty()) {
    if (fused) call.fused = batched;
  } else {
    call = runtime::LeafCall{o.op, groups.size(), run_group, label_group, cost_group};
  }
  z.describe(call);
  try {
    runtime::run(call);
  } catch (...) {
    if (fused_ran)
      runtime::rethrow_with_context(std::current_exception(),
                                    std::string("in-place ") + std::string(o.op) +
                                        ": the fused form failed; leaves may be partly updated");
    std::vector<std::string> updated, untouched;
    const auto paths = target.paths();
    for (std::size_t i = 0; i < leaves; ++i)
      (done[i] ? updated : untouched).push_back(paths[i].str());
    runtime::rethrow_with_context(std::current_exception(),
                                  "in-place " + std::string(o.op) + " updated " +
                                      std::to_string(updated.size()) + " of " +
                                      std::to_string(leaves) + " leaves " + join_paths(updated) +
                                      ", not updated " + join_paths(untouched));
  }
}

}  // namespace treetensor::detail

namespace treetensor::detail {

TreeTensor build_leaves(std::string_view op, const tree::TreeSpec& spec,
                        c10::function_ref<at::Tensor(std::size_t)> f) {
  TreeTensor result = tree::unflatten(spec, std::vector<at::Tensor>(spec.leaf_count()));
  auto flat = tree::flatten_mut(static_cast<TensorTree&>(result));
  auto run = [&](std::size_t i) { *flat.leaves[i] = f(i); };
  auto label = [&](std::size_t i) { return label_of(result, i); };
  runtime::LeafCall call{op, flat.leaves.size(), run, label};
  runtime::run(call);
  return result;
}

}  // namespace treetensor::detail
