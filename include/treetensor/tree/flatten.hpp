#pragma once
// flatten / unflatten and the reusable structure spec (optree parity: leaves + treespec).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "treetensor/tree/core.hpp"

namespace treetensor::tree {

/// The structure of a tree without its leaves: what unflatten() needs to rebuild it.
///
/// Cheap to copy (the node list is shared and immutable). Two specs are equal when their trees
/// have the same keys at the same places; hash() is consistent with ==.
class TreeSpec {
 public:
  /// Number of leaves a tree of this structure holds.
  std::size_t leaf_count() const noexcept { return leaves_; }
  /// Number of nodes (leaves and internal nodes, the root included).
  std::size_t node_count() const noexcept { return data_ ? data_->nodes.size() : 0; }
  /// Leaf paths in flatten order.
  std::vector<Path> paths() const {
    std::vector<Path> out;
    out.reserve(leaves_);
    std::vector<std::string> prefix;
    walk(
        [&](std::string_view key, bool is_root) {
          if (!is_root) prefix.emplace_back(key);
        },
        [&](bool is_root) {
          if (!is_root) prefix.pop_back();
        },
        [&] { out.emplace_back(prefix); });
    return out;
  }

  friend bool operator==(const TreeSpec& a, const TreeSpec& b) noexcept {
    if (a.data_ == b.data_) return true;
    if (!a.data_ || !b.data_) return false;
    return a.leaves_ == b.leaves_ && a.data_->nodes == b.data_->nodes &&
           a.data_->keys == b.data_->keys;
  }

  /// Hash of the structure (keys and arities), consistent with ==.
  std::size_t hash() const noexcept {
    std::size_t h = 0x9e3779b97f4a7c15ull;
    auto mix = [&h](std::size_t v) { h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    if (data_) {
      mix(std::hash<std::string_view>{}(data_->keys));
      for (const Node& n : data_->nodes) mix((std::size_t{n.key_size} << 32) ^ n.arity);
    }
    return h;
  }

 private:
  static constexpr std::uint32_t kLeaf = UINT32_MAX;
  // One node in preorder. Keys are not stored per node: they are concatenated in preorder in
  // Data::keys, each node owning the next key_size characters, so a spec is two allocations
  // and flatten copies no std::string.
  struct Node {
    std::uint32_t key_size;  // 0 for the root
    std::uint32_t arity;     // number of children, or kLeaf
    friend bool operator==(const Node&, const Node&) = default;
  };
  struct Data {
    std::vector<Node> nodes;
    std::string keys;
  };

  // Visits the nodes in preorder without recursion: enter(key, is_root) on every node,
  // leaf() after entering a leaf, leave(is_root) once a node and all below it are done.
  template <class Enter, class Leave, class Leaf>
  void walk(Enter&& enter, Leave&& leave, Leaf&& leaf) const {
    if (!data_) return;
    detail::WalkStack<std::uint32_t> remaining;  // children still to visit, per open node
    std::size_t offset = 0;
    for (const Node& n : data_->nodes) {
      const bool is_root = remaining.empty();
      enter(std::string_view(data_->keys).substr(offset, n.key_size), is_root);
      offset += n.key_size;
      if (n.arity != kLeaf && n.arity != 0) {
        remaining.push(n.arity);
        continue;
      }
      if (n.arity == kLeaf) leaf();
      leave(is_root);
      while (!remaining.empty() && --remaining.back() == 0) {
        remaining.pop();
        leave(remaining.empty());
      }
    }
  }

  template <class T, class It>
  static Tree<T> build(const Data& data, It leaf);

  template <class T, class Leaf>
  friend class Flattener;
  template <class T>
  friend Tree<T> unflatten(const TreeSpec&, std::vector<T>);
  template <class T, std::input_iterator It>
  friend Tree<T> unflatten(const TreeSpec&, It);

  std::shared_ptr<const Data> data_;
  std::size_t leaves_ = 0;
};

/// The leaves of a tree in flatten order and its structure.
template <class L>
struct Flat {
  std::vector<L> leaves;
  TreeSpec spec;
};

/// Walks a tree once, recording the spec and handing each leaf to `take`. Iterative: any depth.
/// Throws std::length_error for a node with 2^32 - 1 children or more, or such a key.
template <class T, class Leaf>
class Flattener {
 public:
  template <class Node, class Take>
  static TreeSpec run(Node& root, Take&& take) {
    return run(root, take, [](std::size_t) {});
  }

  /// Like run(root, take), but first calls reserve(leaf count), so that the caller sizes its
  /// leaf list once. A first pass counts nodes, leaves and key characters: sizing every list
  /// exactly costs less than growing them, most of all on small trees.
  template <class Node, class Take, class Reserve>
  static TreeSpec run(Node& root, Take&& take, Reserve&& reserve) {
    auto data = std::make_shared<TreeSpec::Data>();
    const Sizes sizes = measure(root);
    data->nodes.reserve(sizes.nodes);
    data->keys.reserve(sizes.key_chars);
    reserve(sizes.leaves);
    std::size_t leaves = 0;
    // Records one node; returns its children when it has any.
    auto visit = [&](Node& node, std::string_view key) -> decltype(&root.children()) {
      data->keys.append(key);
      if (node.is_leaf()) {
        data->nodes.push_back({narrow(key.size()), TreeSpec::kLeaf});
        ++leaves;
        take(node.leaf());
        return nullptr;
      }
      auto& children = node.children();
      data->nodes.push_back({narrow(key.size()), narrow(children.size())});
      return children.empty() ? nullptr : &children;
    };
    using It = decltype(root.children().begin());
    struct Frame {
      It it, end;
    };
    detail::WalkStack<Frame> stack;
    if (auto* c = visit(root, {})) stack.push({c->begin(), c->end()});
    while (!stack.empty()) {
      Frame& f = stack.back();
      if (f.it == f.end) {
        stack.pop();
        continue;
      }
      auto& entry = *f.it++;
      if (auto* c = visit(entry.second, entry.first)) stack.push({c->begin(), c->end()});
    }
    TreeSpec spec;
    spec.data_ = std::move(data);
    spec.leaves_ = leaves;
    return spec;
  }

 private:
  struct Sizes {
    std::size_t nodes = 1, leaves = 0, key_chars = 0;
  };

  static Sizes measure(const Tree<T>& root) {
    Sizes n;
    detail::WalkStack<const Tree<T>*> stack;
    stack.push(&root);
    while (!stack.empty()) {
      const Tree<T>* node = stack.back();
      stack.pop();
      if (node->is_leaf()) {
        ++n.leaves;
        continue;
      }
      for (const auto& [key, child] : node->children()) {
        ++n.nodes;
        n.key_chars += key.size();
        stack.push(&child);
      }
    }
    return n;
  }

  static std::uint32_t narrow(std::size_t n) {
    if (n >= TreeSpec::kLeaf) [[unlikely]]
      throw std::length_error("flatten: a node has 2^32 - 1 children or more, or such a key");
    return static_cast<std::uint32_t>(n);
  }
};

// Rebuilds top-down without recursion. Each parent's children are reserved to their exact
// count first, so the pointers kept on the stack stay valid while siblings are added.
template <class T, class It>
Tree<T> TreeSpec::build(const Data& data, It leaf) {
  const Node& root = data.nodes[0];
  if (root.arity == kLeaf) return Tree<T>(*leaf);
  struct Frame {
    typename Tree<T>::Children* out;
    std::uint32_t remaining;
  };
  Tree<T> tree;
  tree.children().reserve(root.arity);
  detail::WalkStack<Frame> stack;
  if (root.arity) stack.push({&tree.children(), root.arity});
  const Node* node = data.nodes.data() + 1;
  const char* key = data.keys.data();
  while (!stack.empty()) {
    Frame& f = stack.back();
    auto* out = f.out;
    std::uint32_t left = f.remaining;
    // Appends this node's children in a tight loop until one has children of its own.
    bool descended = false;
    while (left && !descended) {
      const Node& n = *node++;
      const std::string_view k(key, n.key_size);
      key += n.key_size;
      --left;
      if (n.arity == kLeaf) {
        out->emplace_back(std::piecewise_construct, std::forward_as_tuple(k),
                          std::forward_as_tuple(*leaf));
        ++leaf;  // prefix only: an input iterator's postfix ++ may return void
        continue;
      }
      auto& children = out->emplace_back(std::string(k), Tree<T>()).second.children();
      children.reserve(n.arity);
      if (n.arity) {
        descended = true;
        f.remaining = left;  // before the push, which may move the frames
        stack.push({&children, n.arity});
      }
    }
    if (!descended) stack.pop();
  }
  return tree;
}

/// Leaves (copied) in flatten order — sorted keys, depth first — plus the structure spec.
/// Example: flatten({a:1, b:2, x:{c:3, d:4}}).leaves == {1, 2, 3, 4}.
template <TreeLike A>
Flat<leaf_type_t<A>> flatten(const A& tree) {
  using T = leaf_type_t<A>;
  Flat<T> out;
  out.spec = Flattener<T, T>::run(
      as_tree(tree), [&](const T& v) { out.leaves.push_back(v); },
      [&](std::size_t n) { out.leaves.reserve(n); });
  return out;
}

/// Like flatten(), but returns pointers to the leaves instead of copies (no T copied).
/// The pointers stay valid while the tree's structure is not changed.
template <TreeLike A>
Flat<const leaf_type_t<A>*> flatten_refs(const A& tree) {
  using T = leaf_type_t<A>;
  Flat<const T*> out;
  out.spec = Flattener<T, T>::run(
      as_tree(tree), [&](const T& v) { out.leaves.push_back(&v); },
      [&](std::size_t n) { out.leaves.reserve(n); });
  return out;
}

/// Mutable leaf pointers in flatten order (for in-place updates).
template <class T>
Flat<T*> flatten_mut(Tree<T>& tree) {
  Flat<T*> out;
  out.spec = Flattener<T, T>::run(
      tree, [&](T& v) { out.leaves.push_back(&v); }, [&](std::size_t n) { out.leaves.reserve(n); });
  return out;
}

/// Rebuilds a tree from a spec and its leaves in flatten order.
/// Throws StructureError when leaves.size() != spec.leaf_count().
template <class T>
Tree<T> unflatten(const TreeSpec& spec, std::vector<T> leaves) {
  if (leaves.size() != spec.leaf_count())
    throw StructureError({}, "unflatten: the spec has " + std::to_string(spec.leaf_count()) +
                                 " leaves but " + std::to_string(leaves.size()) + " were given");
  if (!spec.data_) return Tree<T>();
  return TreeSpec::build<T>(*spec.data_, std::make_move_iterator(leaves.begin()));
}

/// Rebuilds a tree from a spec and an iterator over its leaves in flatten order: reads
/// spec.leaf_count() leaves, each dereferenced once, in order (the caller guarantees that
/// many). For leaves that are not in a vector of T already (a Python list's tensors): no
/// vector is made.
template <class T, std::input_iterator It>
Tree<T> unflatten(const TreeSpec& spec, It first) {
  if (!spec.data_) return Tree<T>();
  return TreeSpec::build<T>(*spec.data_, std::move(first));
}

/// Builds a tree from (path, value) pairs in any order, e.g. a state dict with dotted keys:
/// unflatten<int>({{"x.c", 3}, {"a", 1}}) == {a:1, x:{c:3}}.
/// Throws StructureError when one path is a prefix of another or appears twice.
template <class T>
Tree<T> unflatten(std::vector<std::pair<Path, T>> pairs) {
  std::sort(pairs.begin(), pairs.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (std::size_t i = 1; i < pairs.size(); ++i) {
    const Path& prev = pairs[i - 1].first;
    const Path& cur = pairs[i].first;
    if (prev.size() <= cur.size() && std::equal(prev.begin(), prev.end(), cur.begin()))
      throw StructureError(
          cur, "unflatten: path '" + prev.describe() +
                   (prev == cur ? "' appears twice"
                                : "' is both a leaf and the prefix of '" + cur.describe() + "'"));
  }
  if (pairs.size() == 1 && pairs[0].first.empty()) return Tree<T>(std::move(pairs[0].second));
  Tree<T> root;
  for (auto& [path, value] : pairs) {
    if (path.empty()) throw StructureError(path, "unflatten: the root path can only stand alone");
    root.insert(path, Tree<T>(std::move(value)));
  }
  return root;
}

/// unflatten() from dotted paths ("layer1.0.weight").
template <class T>
Tree<T> unflatten(const std::vector<std::pair<std::string, T>>& dotted) {
  std::vector<std::pair<Path, T>> pairs;
  pairs.reserve(dotted.size());
  for (const auto& [key, value] : dotted) pairs.emplace_back(Path::parse(key), value);
  return unflatten<T>(std::move(pairs));
}

}  // namespace treetensor::tree

template <>
struct std::hash<treetensor::tree::TreeSpec> {
  std::size_t operator()(const treetensor::tree::TreeSpec& s) const noexcept { return s.hash(); }
};
