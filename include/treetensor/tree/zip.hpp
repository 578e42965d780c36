#pragma once
// map and n-ary zip-map with treevalue's modes (DESIGN.md §2).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "treetensor/tree/core.hpp"
#include "treetensor/tree/zip_rules.hpp"

namespace treetensor::tree {

/// The value that fills an absent leaf in outer/left zips: made by calling a factory each
/// time it is needed (so mutable fills such as lists are never shared).
template <class M>
struct Missing {
  std::function<M()> make;
};
/// A Missing that copies `value` each time.
template <class M>
Missing<std::decay_t<M>> missing(M value) {
  return {[v = std::move(value)] { return v; }};
}
/// A Missing that calls `factory` each time.
template <class F>
Missing<std::invoke_result_t<F&>> missing_from(F factory) {
  return {std::move(factory)};
}

/// Applies f to every leaf: f(leaf) or f(path, leaf). Returns a tree of the same structure.
/// Exceptions thrown by f propagate unchanged.
template <class F, TreeLike A>
auto map(F&& f, const A& tree);

namespace detail {

struct NoMissing {};

template <class M>
constexpr bool is_missing_v = false;
template <class M>
constexpr bool is_missing_v<Missing<M>> = true;

template <class F, class T>
constexpr bool takes_path_v = std::is_invocable_v<F&, const Path&, const T&>;

template <class R, class T, class F>
Tree<R> map_node(const Tree<T>& node, F& f, std::vector<const std::string*>& trail) {
  if (node.is_leaf()) {
    if constexpr (takes_path_v<F, T>)
      return Tree<R>(f(make_path(trail), node.leaf()));
    else
      return Tree<R>(f(node.leaf()));
  }
  Tree<R> t;
  auto& out = t.children();
  out.reserve(node.size());
  for (const auto& [key, child] : node.children()) {
    trail.push_back(&key);
    if constexpr (!takes_path_v<F, T>) {
      if (child.is_leaf()) {  // built in place, with no Tree moved
        out.emplace_back(std::piecewise_construct, std::forward_as_tuple(key),
                         std::forward_as_tuple(f(child.leaf())));
        trail.pop_back();
        continue;
      }
    }
    out.emplace_back(key, map_node<R>(child, f, trail));
    trail.pop_back();
  }
  return t;
}

// A zip argument: a tree node (possibly absent) or a value broadcast to every leaf.
template <class A>
struct Cursor;

template <class T>
struct TreeCursor {
  using leaf_t = T;
  static constexpr bool is_tree = true;
  const Tree<T>* node;  // nullptr: absent here (outer/left zips)
};

template <class V>
struct ValueCursor {
  using leaf_t = V;
  static constexpr bool is_tree = false;
  const V* value;
};

template <class A>
auto make_cursor(const A& a) {
  if constexpr (TreeLike<A>)
    return TreeCursor<leaf_type_t<A>>{&as_tree(a)};
  else
    return ValueCursor<A>{&a};
}

template <class C>
using cursor_leaf_t = typename C::leaf_t;

// The leaf a cursor yields at a leaf call: the tree's leaf, the broadcast value, or a fill.
template <class C, class M>
const typename C::leaf_t& leaf_of(const C& c, std::optional<typename C::leaf_t>& fill,
                                  const M& missing, std::size_t pos,
                                  const std::vector<const std::string*>& trail) {
  using L = typename C::leaf_t;
  if constexpr (!C::is_tree) {
    return *c.value;
  } else {
    if (c.node) return c.node->leaf();
    if constexpr (std::is_same_v<M, NoMissing>) {
      throw_no_leaf(trail, pos);
    } else if constexpr (std::is_constructible_v<L, decltype(missing.make())>) {
      return fill.emplace(missing.make());
    } else {
      throw StructureError(make_path(trail), "zip: the missing value cannot fill argument " +
                                                 std::to_string(pos) + " at '" +
                                                 make_path(trail).describe() + "'");
    }
  }
}

template <class C>
const typename Tree<typename C::leaf_t>::Children* children_of(const C& c) {
  if constexpr (C::is_tree) {
    if (c.node && !c.node->is_leaf()) return &c.node->children();
  }
  return nullptr;
}

template <class C>
bool is_leaf_cursor(const C& c) {
  if constexpr (C::is_tree) return c.node && c.node->is_leaf();
  return false;
}

// The cursor one level down under `key`: absent when the key is missing.
template <class C>
C child_cursor(const C& c, const std::string& key) {
  if constexpr (!C::is_tree) {
    return c;
  } else {
    if (!c.node || c.node->is_leaf()) return c;  // absent stays absent; a leaf is inherited
    const auto& ch = c.node->children();
    auto it = std::lower_bound(ch.begin(), ch.end(), key,
                               [](const auto& e, const std::string& k) { return e.first < k; });
    return C{it != ch.end() && it->first == key ? &it->second : nullptr};
  }
}

// The cursor tests below run once per child on the fast path and are forced inline, as the
// tree's accessors are (core.hpp).

// Whether a cursor is a value or a tree cursor on a leaf (not absent, not internal).
template <class C>
[[gnu::always_inline]] inline bool is_present_leaf(const C& c) {
  if constexpr (C::is_tree)
    return c.node && c.node->is_leaf();
  else
    return true;
}

// The leaf of a cursor that is_present_leaf() accepted.
template <class C>
[[gnu::always_inline]] inline const typename C::leaf_t& present_leaf(const C& c) {
  if constexpr (C::is_tree)
    return c.node->leaf();
  else
    return *c.value;
}

// Whether a tree cursor is a present internal node with `n` children (the first such cursor
// sets n); value cursors always fit. Part of the fast-path test in Zipper::zip.
template <class C>
[[gnu::always_inline]] inline bool fits_uniform(const C& c, std::size_t& n) {
  if constexpr (!C::is_tree) {
    return true;
  } else {
    if (!c.node || c.node->is_leaf()) return false;
    const std::size_t size = c.node->children().size();
    if (n == SIZE_MAX) n = size;
    return size == n;
  }
}

// The (key, child) array of a tree cursor that fits_uniform() accepted; nullptr for a value.
template <class C>
[[gnu::always_inline]] inline auto entries_of(const C& c) {
  if constexpr (C::is_tree)
    return c.node->children().data();
  else
    return nullptr;
}

// Key equality written out so that it inlines: keys are short, and a memcmp call (or a byte
// loop) per key was most of a zip's time. Compares 8- or 4-byte words, the last one
// overlapping the previous.
[[gnu::always_inline]] inline bool same_key(const std::string& a, const std::string& b) noexcept {
  const std::size_t n = a.size();
  if (n != b.size()) return false;
  const char* p = a.data();
  const char* q = b.data();
  auto word = [](const char* s, auto width) {
    decltype(width) v;
    std::memcpy(&v, s, sizeof v);
    return v;
  };
  if (n >= 8) {
    for (std::size_t i = 0; i + 8 < n; i += 8)
      if (word(p + i, std::uint64_t{}) != word(q + i, std::uint64_t{})) return false;
    return word(p + n - 8, std::uint64_t{}) == word(q + n - 8, std::uint64_t{});
  }
  if (n >= 4)
    return word(p, std::uint32_t{}) == word(q, std::uint32_t{}) &&
           word(p + n - 4, std::uint32_t{}) == word(q + n - 4, std::uint32_t{});
  for (std::size_t i = 0; i < n; ++i)
    if (p[i] != q[i]) return false;
  return true;
}

template <class E>
[[gnu::always_inline]] inline bool key_at_is(E entries, std::size_t i,
                                             const std::string& key) noexcept {
  if constexpr (std::is_null_pointer_v<E>)
    return true;
  else
    return same_key(entries[i].first, key);
}

// The cursor of the i-th child (fast path); a value cursor stays itself.
template <class C, class E>
[[gnu::always_inline]] inline C child_at(const C& c, E entries, std::size_t i) {
  if constexpr (std::is_null_pointer_v<E>)
    return c;
  else
    return C{&entries[i].second};
}

template <class C>
std::vector<std::string> keys_of(const C& c) {
  std::vector<std::string> out;
  if (const auto* ch = children_of(c))
    for (const auto& e : *ch) out.push_back(e.first);
  return out;
}

template <class F, class... C>
using zip_result_t = std::decay_t<
    typename std::conditional_t<std::is_invocable_v<F&, const Path&, const cursor_leaf_t<C>&...>,
                                std::invoke_result<F&, const Path&, const cursor_leaf_t<C>&...>,
                                std::invoke_result<F&, const cursor_leaf_t<C>&...>>::type>;

template <class F, class M, class... C>
class Zipper {
 public:
  using R = zip_result_t<F, C...>;

  Zipper(F& f, const ZipOptions& o, const M& missing) : f_(f), o_(o), missing_(missing) {}

  Tree<R> zip(const C&... cs) {
    if ((is_present_leaf(cs) && ...)) return Tree<R>(call_leaves(cs...));
    Tree<R> out;
    zip_node(out, cs...);
    return out;
  }

 private:
  // Append (key, zip of the cursors), built in place: no Tree is moved, leaf or subtree.
  // emplace_leaf: every tree cursor is a present leaf (is_present_leaf).
  void emplace_leaf(typename Tree<R>::Children& out, const std::string& key, const C&... cs) {
    out.emplace_back(std::piecewise_construct, std::forward_as_tuple(key),
                     std::forward_as_tuple(call_leaves(cs...)));
  }
  void emplace_subtree(typename Tree<R>::Children& out, const std::string& key, const C&... cs) {
    auto& child = out.emplace_back(std::piecewise_construct, std::forward_as_tuple(key),
                                   std::forward_as_tuple());
    zip_node(child.second, cs...);
  }

  // Internal nodes (and absent arguments) into the empty `out`, out of line so that the leaf
  // path stays small.
  [[gnu::noinline]] void zip_node(Tree<R>& out, const C&... cs) {
    if (!zip_uniform(out, cs...)) out = zip_general(cs...);
  }

  // Any mode, absent and inherited arguments: merges the key sets, then descends by key.
  [[gnu::noinline]] Tree<R> zip_general(const C&... cs) {
    std::size_t internal = 0, leaves = 0;
    ((children_of(cs) ? ++internal : 0), ...);
    ((is_leaf_cursor(cs) ? ++leaves : 0), ...);
    if (internal == 0) return Tree<R>(call(cs...));
    if (leaves && !o_.inherit) leaf_faces_subtree(cs...);
    std::vector<std::string> keys = merged_keys(cs...);
    typename Tree<R>::Children out;
    out.reserve(keys.size());
    for (const auto& key : keys) {
      trail_.push_back(&key);
      out.emplace_back(key, zip(child_cursor(cs, key)...));
      trail_.pop_back();
    }
    Tree<R> t;
    t.children() = std::move(out);
    return t;
  }

  decltype(auto) call(const C&... cs) { return call_impl(std::index_sequence_for<C...>{}, cs...); }

  template <std::size_t... I>
  decltype(auto) call_impl(std::index_sequence<I...>, const C&... cs) {
    std::tuple<std::optional<cursor_leaf_t<C>>...> fills;
    if constexpr (kTakesPath)
      return f_(make_path(trail_), leaf_of(cs, std::get<I>(fills), missing_, I, trail_)...);
    else
      return f_(leaf_of(cs, std::get<I>(fills), missing_, I, trail_)...);
  }

  static constexpr bool kTakesPath =
      std::is_invocable_v<F&, const Path&, const cursor_leaf_t<C>&...>;

  // Every tree argument is a leaf here (the most common call): no fills, no counting.
  decltype(auto) call_leaves(const C&... cs) {
    if constexpr (kTakesPath)
      return f_(make_path(trail_), present_leaf(cs)...);
    else
      return f_(present_leaf(cs)...);
  }

  // The common case: every tree argument is an internal node and all have the same keys in
  // the same order. Compares keys index-wise and descends by index, with no key lists built
  // and no lookups. Returns false (leaving `out` alone) when the general path is needed.
  bool zip_uniform(Tree<R>& out, const C&... cs) {
    std::size_t n = SIZE_MAX;
    if (!(fits_uniform(cs, n) && ...) || n == SIZE_MAX) return false;
    return zip_uniform_n(out, n, std::index_sequence_for<C...>{}, cs...);
  }

  // The first tree argument's position: its keys name the children on the fast path.
  static constexpr std::size_t kFirstTree = [] {
    constexpr bool is_tree[] = {C::is_tree...};
    std::size_t i = 0;
    while (!is_tree[i]) ++i;
    return i;
  }();

  template <std::size_t... I>
  bool zip_uniform_n(Tree<R>& out, std::size_t n, std::index_sequence<I...>, const C&... cs) {
    const auto entries = std::make_tuple(entries_of(cs)...);
    const auto* first = std::get<kFirstTree>(entries);
    for (std::size_t i = 0; i < n; ++i)
      if (!((I == kFirstTree || key_at_is(std::get<I>(entries), i, first[i].first)) && ...))
        return false;
    auto& children = out.children();
    children.reserve(n);
    for (std::size_t i = 0; i < n; ++i) {
      const std::string& key = first[i].first;
      const bool leaves = (is_present_leaf(child_at(cs, std::get<I>(entries), i)) && ...);
      // The trail is read only by f with a path and by the walks below a subtree (their
      // messages): a leaf call of f without one needs none.
      const bool trail = kTakesPath || !leaves;
      if (trail) trail_.push_back(&key);
      if (leaves)
        emplace_leaf(children, key, child_at(cs, std::get<I>(entries), i)...);
      else
        emplace_subtree(children, key, child_at(cs, std::get<I>(entries), i)...);
      if (trail) trail_.pop_back();
    }
    return true;
  }

  [[noreturn]] void leaf_faces_subtree(const C&... cs) {
    std::size_t pos = 0, leaf_pos = 0, tree_pos = 0;
    bool seen_leaf = false, seen_tree = false;
    ((is_leaf_cursor(cs) && !seen_leaf ? (seen_leaf = true, leaf_pos = pos) : 0,
      children_of(cs) && !seen_tree ? (seen_tree = true, tree_pos = pos) : 0, ++pos),
     ...);
    std::vector<std::vector<std::string>> all{keys_of(cs)...};
    throw_leaf_faces_subtree(trail_, leaf_pos, tree_pos, all[tree_pos]);
  }

  // The key list at one internal node, per mode (zip_rules.hpp).
  std::vector<std::string> merged_keys(const C&... cs) {
    KeySets sets;
    std::size_t pos = 0;
    ((children_of(cs) ? (sets.keys.push_back(keys_of(cs)), sets.positions.push_back(pos)) : void(),
      ++pos),
     ...);
    return merge_keys(sets, o_.mode, !std::is_same_v<M, NoMissing>, trail_);
  }

  F& f_;
  ZipOptions o_;
  const M& missing_;
  std::vector<const std::string*> trail_;
};

template <class F, class M, class... A>
auto zip_impl(const ZipOptions& o, const M& missing, F& f, const A&... args) {
  static_assert((TreeLike<A> || ...), "zip_map needs at least one tree argument");
  using Z = Zipper<F, M, decltype(make_cursor(args))...>;
  Z z(f, o, missing);
  return z.zip(make_cursor(args)...);
}

}  // namespace detail

template <class F, TreeLike A>
auto map(F&& f, const A& tree) {
  using T = leaf_type_t<A>;
  using R = detail::zip_result_t<F, detail::TreeCursor<T>>;
  std::vector<const std::string*> trail;
  return detail::map_node<R>(as_tree(tree), f, trail);
}

/// Applies f leaf-wise over several arguments: trees are zipped key by key, other arguments
/// (scalars, single values) are broadcast to every leaf. f takes the leaves, or (path, leaves)
/// when it is invocable that way (so a variadic generic lambda receives the path first).
///
/// Throws StructureError naming the path, the argument positions and both key sets when the
/// structures do not fit the mode, or when a leaf faces a subtree without `inherit`.
/// Example: zip_map(std::plus<>{}, t, u) is t + u leaf-wise.
template <class F, class... A>
requires(!std::is_same_v<std::decay_t<F>, ZipOptions>) auto zip_map(F&& f, const A&... args) {
  return detail::zip_impl(ZipOptions{}, detail::NoMissing{}, f, args...);
}

/// zip_map() with a mode and inherit flag, without a missing value (absent keys throw).
template <class F, class... A>
requires(!detail::is_missing_v<std::decay_t<F>>) auto zip_map(const ZipOptions& options, F&& f,
                                                              const A&... args) {
  return detail::zip_impl(options, detail::NoMissing{}, f, args...);
}

/// zip_map() whose absent leaves (outer/left modes) are filled from `missing`.
template <class M, class F, class... A>
auto zip_map(const ZipOptions& options, const Missing<M>& fill, F&& f, const A&... args) {
  return detail::zip_impl(options, fill, f, args...);
}

/// Calls f(leaf) or f(path, leaf) on every leaf in flatten order; f may modify the leaf when
/// the tree is not const.
template <class T, class F>
void for_each(Tree<T>& tree, F&& f) {
  std::vector<const std::string*> trail;
  auto walk = [&](auto& self, Tree<T>& node) -> void {
    if (node.is_leaf()) {
      if constexpr (std::is_invocable_v<F&, const Path&, T&>)
        f(detail::make_path(trail), node.leaf());
      else
        f(node.leaf());
      return;
    }
    for (auto& [key, child] : node.children()) {
      trail.push_back(&key);
      self(self, child);
      trail.pop_back();
    }
  };
  walk(walk, tree);
}

}  // namespace treetensor::tree
