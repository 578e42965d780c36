#pragma once
// flatten / unflatten and the reusable structure spec (optree parity: leaves + treespec).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
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
  std::size_t node_count() const noexcept { return nodes_ ? nodes_->size() : 0; }
  /// Leaf paths in flatten order.
  std::vector<Path> paths() const {
    std::vector<Path> out;
    out.reserve(leaves_);
    Path prefix;
    std::size_t i = 0;
    if (nodes_) collect(i, prefix, out);
    return out;
  }

  friend bool operator==(const TreeSpec& a, const TreeSpec& b) noexcept {
    if (a.nodes_ == b.nodes_) return true;
    if (!a.nodes_ || !b.nodes_) return false;
    return a.leaves_ == b.leaves_ && *a.nodes_ == *b.nodes_;
  }

  /// Hash of the structure (keys and arities), consistent with ==.
  std::size_t hash() const noexcept {
    std::size_t h = 0x9e3779b97f4a7c15ull;
    if (nodes_)
      for (const auto& n : *nodes_) {
        h ^= std::hash<std::string>{}(n.key) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
        h ^= std::hash<std::uint32_t>{}(n.arity) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
      }
    return h;
  }

 private:
  static constexpr std::uint32_t kLeaf = UINT32_MAX;
  struct Node {
    std::string key;      // empty for the root
    std::uint32_t arity;  // number of children, or kLeaf
    friend bool operator==(const Node&, const Node&) = default;
  };

  void collect(std::size_t& i, Path& prefix, std::vector<Path>& out) const {
    const Node& n = (*nodes_)[i++];
    if (n.arity == kLeaf) {
      out.push_back(prefix);
      return;
    }
    for (std::uint32_t c = 0; c < n.arity; ++c) {
      prefix.push_back((*nodes_)[i].key);
      collect(i, prefix, out);
      prefix.pop_back();
    }
  }

  template <class T, class It>
  static Tree<T> build(const std::vector<Node>& nodes, std::size_t& i, It& leaf) {
    const Node& n = nodes[i++];
    if (n.arity == kLeaf) return Tree<T>(*leaf++);
    typename Tree<T>::Children children;
    children.reserve(n.arity);
    for (std::uint32_t c = 0; c < n.arity; ++c) {
      const std::string& key = nodes[i].key;
      children.emplace_back(key, build<T>(nodes, i, leaf));
    }
    Tree<T> t;
    t.children() = std::move(children);  // already sorted: the spec came from a tree
    return t;
  }

  template <class T, class Leaf>
  friend class Flattener;
  template <class T>
  friend Tree<T> unflatten(const TreeSpec&, std::vector<T>);

  std::shared_ptr<const std::vector<Node>> nodes_;
  std::size_t leaves_ = 0;
};

/// The leaves of a tree in flatten order and its structure.
template <class L>
struct Flat {
  std::vector<L> leaves;
  TreeSpec spec;
};

/// Walks a tree once, recording the spec and handing each leaf to `take`.
template <class T, class Leaf>
class Flattener {
 public:
  template <class Node, class Take>
  static TreeSpec run(Node& root, Take&& take) {
    auto nodes = std::make_shared<std::vector<TreeSpec::Node>>();
    std::size_t leaves = 0;
    walk(root, std::string(), *nodes, leaves, take);
    TreeSpec spec;
    spec.nodes_ = std::move(nodes);
    spec.leaves_ = leaves;
    return spec;
  }

 private:
  template <class Node, class Take>
  static void walk(Node& node, const std::string& key, std::vector<TreeSpec::Node>& nodes,
                   std::size_t& leaves, Take& take) {
    if (node.is_leaf()) {
      nodes.push_back({key, TreeSpec::kLeaf});
      ++leaves;
      take(node.leaf());
      return;
    }
    auto& children = node.children();
    nodes.push_back({key, static_cast<std::uint32_t>(children.size())});
    for (auto& [k, child] : children) walk(child, k, nodes, leaves, take);
  }
};

/// Leaves (copied) in flatten order — sorted keys, depth first — plus the structure spec.
/// Example: flatten({a:1, b:2, x:{c:3, d:4}}).leaves == {1, 2, 3, 4}.
template <TreeLike A>
Flat<leaf_type_t<A>> flatten(const A& tree) {
  using T = leaf_type_t<A>;
  Flat<T> out;
  out.spec = Flattener<T, T>::run(as_tree(tree), [&](const T& v) { out.leaves.push_back(v); });
  return out;
}

/// Like flatten(), but returns pointers to the leaves instead of copies (no T copied).
/// The pointers stay valid while the tree's structure is not changed.
template <TreeLike A>
Flat<const leaf_type_t<A>*> flatten_refs(const A& tree) {
  using T = leaf_type_t<A>;
  Flat<const T*> out;
  out.spec = Flattener<T, T>::run(as_tree(tree), [&](const T& v) { out.leaves.push_back(&v); });
  return out;
}

/// Mutable leaf pointers in flatten order (for in-place updates).
template <class T>
Flat<T*> flatten_mut(Tree<T>& tree) {
  Flat<T*> out;
  out.spec = Flattener<T, T>::run(tree, [&](T& v) { out.leaves.push_back(&v); });
  return out;
}

/// Rebuilds a tree from a spec and its leaves in flatten order.
/// Throws StructureError when leaves.size() != spec.leaf_count().
template <class T>
Tree<T> unflatten(const TreeSpec& spec, std::vector<T> leaves) {
  if (leaves.size() != spec.leaf_count())
    throw StructureError({}, "unflatten: the spec has " + std::to_string(spec.leaf_count()) +
                                 " leaves but " + std::to_string(leaves.size()) + " were given");
  if (!spec.nodes_) return Tree<T>();
  std::size_t i = 0;
  auto it = std::make_move_iterator(leaves.begin());
  return TreeSpec::build<T>(*spec.nodes_, i, it);
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
      throw StructureError(cur, "unflatten: path '" + prev.describe() +
                                    (prev == cur ? "' appears twice" : "' is both a leaf and the prefix of '" + cur.describe() + "'"));
  }
  if (pairs.size() == 1 && pairs[0].first.empty()) return Tree<T>(std::move(pairs[0].second));
  Tree<T> root;
  for (auto& [path, value] : pairs) {
    if (path.empty())
      throw StructureError(path, "unflatten: the root path can only stand alone");
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
