#pragma once
// filter, mask, reduce, subside/rise and union over Tree<T> (treevalue parity).

#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "treetensor/tree/core.hpp"
#include "treetensor/tree/zip.hpp"

namespace treetensor::tree {

/// Options of filter() and mask().
struct FilterOptions {
  /// Keep internal nodes whose leaves were all dropped, as empty subtrees. Off by default
  /// (treevalue drops them).
  bool keep_empty = false;
};

namespace detail {
template <class T, class Keep>
std::optional<Tree<T>> filter_node(const Tree<T>& node, Keep& keep, const FilterOptions& o,
                                   std::vector<const std::string*>& trail) {
  if (node.is_leaf()) {
    if (keep(node.leaf(), trail)) return node;
    return std::nullopt;
  }
  typename Tree<T>::Children out;
  for (const auto& [key, child] : node.children()) {
    trail.push_back(&key);
    if (auto kept = filter_node(child, keep, o, trail)) out.emplace_back(key, std::move(*kept));
    trail.pop_back();
  }
  if (out.empty() && !node.empty() && !o.keep_empty && !trail.empty()) return std::nullopt;
  Tree<T> t;
  t.children() = std::move(out);
  return t;
}
}  // namespace detail

/// The leaves for which pred(leaf) (or pred(path, leaf)) is true, in their places. Subtrees
/// left empty are dropped unless `keep_empty`; the root is always kept (an empty tree).
/// Example: filter(odd, {a:1, b:2, x:{c:3, d:4}}) == {a:1, x:{c:3}}.
template <class T, class P>
Tree<T> filter(P&& pred, const Tree<T>& tree, FilterOptions options = {}) {
  auto keep = [&](const T& leaf, const std::vector<const std::string*>& trail) -> bool {
    if constexpr (std::is_invocable_v<P&, const Path&, const T&>)
      return pred(detail::make_path(trail), leaf);
    else
      return pred(leaf);
  };
  std::vector<const std::string*> trail;
  auto out = detail::filter_node(tree, keep, options, trail);
  return out ? std::move(*out) : Tree<T>();
}

/// The leaves of `tree` where the tree of flags `keep` is true. The two must have the same
/// structure (strict zip; StructureError naming the path and key sets otherwise).
template <class T>
Tree<T> mask(const Tree<T>& tree, const Tree<bool>& keep, FilterOptions options = {}) {
  Tree<std::pair<T, bool>> tagged =
      zip_map([](const T& v, bool k) { return std::pair<T, bool>(v, k); }, tree, keep);
  Tree<std::pair<T, bool>> kept =
      filter([](const std::pair<T, bool>& p) { return p.second; }, tagged, options);
  return map([](const std::pair<T, bool>& p) { return p.first; }, kept);
}

/// Bottom-up reduce: each leaf becomes leaf_fn(leaf); each internal node becomes
/// node_fn(children), where children is a vector of (key, reduced value) in key order.
/// Example: reduce(t, [](int v) { return v; }, sum_of_values) sums every leaf.
template <class T, class LeafFn, class NodeFn>
auto reduce(const Tree<T>& tree, LeafFn&& leaf_fn, NodeFn&& node_fn) {
  using R = std::decay_t<std::invoke_result_t<LeafFn&, const T&>>;
  auto walk = [&](auto& self, const Tree<T>& node) -> R {
    if (node.is_leaf()) return leaf_fn(node.leaf());
    std::vector<std::pair<std::string_view, R>> values;
    values.reserve(node.size());
    for (const auto& [key, child] : node.children()) values.emplace_back(key, self(self, child));
    return node_fn(values);
  };
  return walk(walk, tree);
}

/// reduce() whose leaves enter node_fn as they are.
template <class T, class NodeFn>
T reduce(const Tree<T>& tree, NodeFn&& node_fn) {
  return reduce(
      tree, [](const T& v) { return v; }, node_fn);
}

namespace detail {
template <class T>
std::vector<std::string> keys_of_tree(const Tree<T>& t) {
  std::vector<std::string> out;
  for (const auto& e : t.children()) out.push_back(e.first);
  return out;
}

template <class T>
bool same_keys(const Tree<T>& a, const Tree<T>& b) {
  const auto &ca = a.children(), &cb = b.children();
  if (ca.size() != cb.size()) return false;
  for (std::size_t i = 0; i < ca.size(); ++i)
    if (ca[i].first != cb[i].first) return false;
  return true;
}

template <class T>
Tree<std::vector<T>> subside_node(const std::vector<const Tree<T>*>& nodes,
                                  std::vector<const std::string*>& trail) {
  const bool leaf = nodes[0]->is_leaf();
  for (std::size_t i = 1; i < nodes.size(); ++i)
    if (nodes[i]->is_leaf() != leaf || (!leaf && !same_keys(*nodes[0], *nodes[i]))) {
      Path here = make_path(trail);
      auto keys = [](const Tree<T>& t) {
        return t.is_leaf() ? std::string("a leaf") : "keys " + format_keys(keys_of_tree(t));
      };
      throw StructureError(here, "subside: at '" + here.describe() + "' tree 0 has " +
                                     keys(*nodes[0]) + " but tree " + std::to_string(i) + " has " +
                                     keys(*nodes[i]));
    }
  if (leaf) {
    std::vector<T> values;
    values.reserve(nodes.size());
    for (const auto* n : nodes) values.push_back(n->leaf());
    return Tree<std::vector<T>>(std::move(values));
  }
  typename Tree<std::vector<T>>::Children out;
  std::vector<const Tree<T>*> kids(nodes.size());
  for (std::size_t c = 0; c < nodes[0]->size(); ++c) {
    for (std::size_t i = 0; i < nodes.size(); ++i) kids[i] = &nodes[i]->children()[c].second;
    const std::string& key = nodes[0]->children()[c].first;
    trail.push_back(&key);
    out.emplace_back(key, subside_node(kids, trail));
    trail.pop_back();
  }
  Tree<std::vector<T>> t;
  t.children() = std::move(out);
  return t;
}
}  // namespace detail

/// A tree of vectors from a vector of trees with equal structure: the i-th element of each
/// leaf vector comes from trees[i] (treevalue's subside). Throws StructureError naming the
/// path and the differing trees' key sets; std::invalid_argument for an empty vector.
template <class T>
Tree<std::vector<T>> subside(const std::vector<Tree<T>>& trees) {
  if (trees.empty()) throw std::invalid_argument("subside: needs at least one tree");
  std::vector<const Tree<T>*> nodes;
  for (const auto& t : trees) nodes.push_back(&t);
  std::vector<const std::string*> trail;
  return detail::subside_node(nodes, trail);
}

/// The inverse of subside(): n trees from a tree whose leaves are vectors of length n.
/// Throws StructureError naming the first leaf whose length differs. A tree without leaves
/// rises to an empty vector.
template <class T>
std::vector<Tree<T>> rise(const Tree<std::vector<T>>& tree) {
  std::size_t n = 0;
  bool first = true;
  for (const Path& p : tree.paths()) {
    const std::size_t len = tree.at(p).leaf().size();
    if (first) n = len, first = false;
    if (len != n)
      throw StructureError(p, "rise: leaf '" + p.describe() + "' has " + std::to_string(len) +
                                  " elements, the first leaf has " + std::to_string(n));
  }
  std::vector<Tree<T>> out;
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i)
    out.push_back(map([i](const std::vector<T>& v) { return v[i]; }, tree));
  return out;
}

/// rise() for tuple-like leaves: a tuple of trees, one per element (e.g. min(dim) results).
template <class... Ts>
std::tuple<Tree<Ts>...> rise(const Tree<std::tuple<Ts...>>& tree) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::tuple<Tree<Ts>...>(
        map([](const std::tuple<Ts...>& v) { return std::get<I>(v); }, tree)...);
  }
  (std::index_sequence_for<Ts...>{});
}
template <class A, class B>
std::pair<Tree<A>, Tree<B>> rise(const Tree<std::pair<A, B>>& tree) {
  return {map([](const std::pair<A, B>& v) { return v.first; }, tree),
          map([](const std::pair<A, B>& v) { return v.second; }, tree)};
}

/// Zips the leaves of several trees into tuples (treevalue's union): strict structure.
template <TreeLike... A>
auto union_(const A&... trees) {
  return zip_map([](const leaf_type_t<A>&... leaves) { return std::make_tuple(leaves...); },
                 trees...);
}

}  // namespace treetensor::tree
