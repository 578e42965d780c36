#pragma once
// Tree<T>: a leaf holding a T, or a map from string keys to trees, in sorted key order
// (DESIGN.md §1). Standard library only.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "treetensor/tree/node_allocator.hpp"
#include "treetensor/tree/path.hpp"

namespace treetensor::tree {

template <class T>
class Tree;

namespace detail {
template <class T>
T leaf_type_of(const Tree<T>*);

/// The explicit stack of the iterative walks (flatten, unflatten, printing, destruction, ...),
/// which must not recurse once per tree level: a deep tree would overflow the call stack.
/// The first N entries live inline, so walks of trees up to N levels deep do not allocate.
template <class E, std::size_t N = 32>
class WalkStack {
 public:
  bool empty() const noexcept { return size_ == 0; }
  std::size_t size() const noexcept { return size_; }
  E& back() noexcept { return size_ <= N ? inline_[size_ - 1] : heap_.back(); }
  void push(E e) {
    if (size_ < N)
      inline_[size_] = std::move(e);
    else
      heap_.push_back(std::move(e));
    ++size_;
  }
  void pop() noexcept {
    if (size_ > N) heap_.pop_back();
    --size_;
  }

 private:
  std::array<E, N> inline_;
  std::vector<E> heap_;
  std::size_t size_ = 0;
};

/// Where the last operator[] on this thread led, so a chained `t["a"]["b"]["c"]` can name the
/// whole path in its KeyError. Only a lookup on the very node the previous one returned
/// continues the trail, so an unrelated node never borrows another node's path.
struct AccessTrail {
  const void* node = nullptr;
  Path path;
};
inline thread_local AccessTrail access_trail;
}  // namespace detail

/// True for Tree<T> and classes derived from it (e.g. TreeTensor).
template <class A>
concept TreeLike = requires {
  detail::leaf_type_of(static_cast<const std::decay_t<A>*>(nullptr));
};

/// The leaf type of a TreeLike type.
template <TreeLike A>
using leaf_type_t = decltype(detail::leaf_type_of(static_cast<const std::decay_t<A>*>(nullptr)));

/// A tree of T: either a leaf holding a T, or an internal node mapping string keys to subtrees.
///
/// Children are kept sorted by key, so iteration, printing and flatten order are the same in
/// every process that builds the same tree (DESIGN.md §1). Trees are values: copying a tree
/// copies its structure (and each leaf T), so a change to one copy never shows in the other.
/// A default-constructed tree is an empty internal node.
///
/// Depth: flatten/unflatten, paths(), depth(), leaf_count(), at/insert/erase, printing and
/// destruction walk iteratively, so any depth works. Copies, ==, map, zip_map, filter, mask,
/// reduce, subside and rise recurse once per level, a few hundred bytes of stack each (more
/// under sanitizers): 10,000 levels fit a default 8 MiB stack in optimised builds.
///
/// Thread safety: as for standard containers, const operations may run concurrently; a
/// mutation needs exclusive access to the tree.
///
/// Example:
///   Tree<int> t = {{"a", 1}, {"b", 2}, {"x", {{"c", 3}, {"d", 4}}}};
///   t.at("x.c") == Tree<int>(3);  t["x"]["d"].leaf() == 4;
template <class T>
class Tree {
 public:
  using value_type = T;
  using Entry = std::pair<std::string, Tree>;
  /// A node's children, sorted by key; their array comes from a per-thread cache of freed
  /// arrays (detail::NodeAllocator), so building and dropping trees stays in the process.
  using Children = std::vector<Entry, detail::NodeAllocator<Entry>>;

  /// What a deferred tree is made from (see deferred()): make() builds the tree on first
  /// access. make() may throw: the exception leaves that access (accessors of a deferred tree
  /// are therefore not noexcept), the tree stays deferred, and the next access calls make()
  /// again. A pending source (pending() true) stands for work still in flight, e.g. an asyncs
  /// pending result (DESIGN.md §10): make() may block until it is done, and once made the
  /// tree takes the made tree's own source as its property instead of the pending one.
  class Source {
   public:
    virtual ~Source() = default;
    virtual Tree make() const = 0;
    virtual bool pending() const noexcept { return false; }
    /// A pending source: blocks until make() would no longer wait for the work, or `timeout`
    /// has passed; whether it would not (a reader waiting in slices, e.g. to let Python handle
    /// Ctrl-C between them). Never throws the work's error: make() does. By default true:
    /// make() does all the waiting.
    virtual bool wait_for(std::chrono::milliseconds /*timeout*/) const { return true; }
  };

  /// The empty tree (an internal node without children).
  Tree() = default;
  Tree(const Tree& other) : Tree(other, other.lazy_state()) {}
  Tree(Tree&&) = default;
  Tree& operator=(const Tree& other) {
    if (this != &other) *this = Tree(other);
    return *this;
  }
  Tree& operator=(Tree&&) = default;

  /// A tree whose content is made by `source` on first access (any accessor, copy of a made
  /// tree, walk) and cached; until then it costs one allocation, whatever its size. The
  /// source stays attached as a property of the value: source() returns it until the tree is
  /// mutated through a non-const accessor, insert, erase or assignment, and copies carry it.
  /// Used by consolidated tree tensors (DESIGN.md §12), whose leaf tensors are views made
  /// only when someone looks at them, and by asyncs pending results (a pending source).
  /// Thread safety: concurrent const use of one deferred tree makes it exactly once (or, when
  /// make() throws, each access in turn tries again).
  static Tree deferred(std::shared_ptr<const Source> source) {
    Tree t;
    t.lazy_ = std::make_unique<Lazy>(std::move(source));
    return t;
  }
  /// `value` with `source` attached as its property (see deferred()); nothing is deferred.
  static Tree tagged(Tree value, std::shared_ptr<const Source> source) {
    value.node();
    value.lazy_ = std::make_unique<Lazy>(std::move(source));
    value.lazy_->made.store(true, std::memory_order_relaxed);
    return value;
  }
  /// The source attached by deferred() or tagged(), or nullptr (never had one, or mutated).
  /// A pending tree is made first (this may block and throw as make() does): its property is
  /// the made tree's.
  const Source* source() const {
    if (!lazy_) return nullptr;
    if (!lazy_->pending) return lazy_->source.get();
    node();
    return lazy_->adopted.get();
  }
  /// Whether this is a deferred tree not made yet (its content has never been looked at).
  bool is_deferred() const noexcept {
    return lazy_ && !lazy_->made.load(std::memory_order_acquire);
  }
  /// Whether this is a deferred tree of a pending source not made yet: its first access may
  /// block (and throw) until the work it stands for is done.
  bool is_pending() const noexcept { return is_deferred() && lazy_->pending; }
  /// The pending source this tree was deferred on, made or not, without making it (nullptr
  /// for a tree that has none). One read: stable while another thread makes the tree.
  const Source* pending_source() const noexcept {
    return lazy_ && lazy_->pending ? lazy_->source.get() : nullptr;
  }
  /// Destroys the tree. Recursion is bounded (kRecursionLimit levels, then an explicit
  /// worklist), so a tree of any depth is safe.
  ~Tree() {
    auto* c = std::get_if<0>(&node_);
    if (c && !c->empty()) destroy_children(*c);  // leaves and empty nodes: nothing out of line
  }

  /// A leaf holding T(value).
  template <class U>
  requires(std::constructible_from<T, U&&> && !TreeLike<U>) Tree(U&& value)
      : node_(std::in_place_index<1>, std::forward<U>(value)) {}  // NOLINT

  /// A leaf of a container type from a braced list: `Tree<std::vector<int64_t>> s = {2, 3};`.
  template <class V = T>
  requires requires {
    typename V::value_type;
  } && std::constructible_from<V, std::initializer_list<typename V::value_type>> Tree(
      std::initializer_list<typename V::value_type> values)  // NOLINT
      : node_(std::in_place_index<1>, T(values)) {
  }

  /// An internal node from (key, subtree) pairs in any order.
  /// Throws std::invalid_argument on a duplicate key.
  Tree(std::initializer_list<Entry> entries) : node_(std::in_place_index<0>, entries) {
    sort_and_check(std::get<0>(node_));
  }

  /// An internal node from (key, subtree) pairs in any order; duplicate keys throw.
  static Tree from_children(Children entries) {
    Tree t;
    sort_and_check(entries);
    std::get<0>(t.node_) = std::move(entries);
    return t;
  }

  // ---- structure ----------------------------------------------------------------------
  // is_leaf(), leaf(), children() and node() are forced inline: every walk calls them once
  // per node, and GCC's -O2 heuristics left them out of line in the zip walk (a sixth of its
  // time in bench/tree_bench).
  [[gnu::always_inline]] bool is_leaf() const { return node().index() == 1; }
  /// An internal node without children.
  bool empty() const { return !is_leaf() && std::get<0>(node_).empty(); }
  /// Number of children (0 for a leaf).
  std::size_t size() const { return is_leaf() ? 0 : std::get<0>(node_).size(); }
  /// Number of key levels: 0 for a leaf or an empty tree, 1 for {a: 1}, 2 for {x: {c: 3}}.
  std::size_t depth() const;
  /// Number of leaves below this node (1 for a leaf).
  std::size_t leaf_count() const;

  /// The leaf value. Throws StructureError when this node is not a leaf.
  [[gnu::always_inline]] const T& leaf() const {
    if (!is_leaf()) [[unlikely]]
      throw_not_leaf();
    return *std::get_if<1>(&node_);
  }
  T& leaf() {
    drop_source();
    return const_cast<T&>(std::as_const(*this).leaf());
  }

  /// The sorted (key, subtree) pairs. Throws StructureError on a leaf.
  [[gnu::always_inline]] const Children& children() const {
    if (is_leaf()) [[unlikely]]
      throw_leaf_has_no_children();
    return *std::get_if<0>(&node_);
  }
  Children& children() {
    drop_source();
    return const_cast<Children&>(std::as_const(*this).children());
  }

  auto begin() const { return children().begin(); }
  auto end() const { return children().end(); }

  // ---- access -------------------------------------------------------------------------
  /// The child under one key (no path splitting). Throws KeyError naming the key and the
  /// available keys when it is missing, or when this node is a leaf. In a chain
  /// `t["model"]["enc"]["layer2"]` the message names the whole path walked from `t`
  /// ("model.enc.layer2"), as at("model.enc.layer2") does.
  const Tree& operator[](std::string_view key) const {
    auto& trail = detail::access_trail;
    Path walked = trail.node == this ? std::move(trail.path) : Path{};
    trail.node = nullptr;
    const Tree* child = child_or_throw(key, walked);
    walked.push_back(std::string(key));
    trail.node = child;
    trail.path = std::move(walked);
    return *child;
  }
  Tree& operator[](std::string_view key) {
    drop_source();
    return const_cast<Tree&>(std::as_const(*this)[key]);
  }

  /// The node at a dotted path ("x.c") or key sequence (Path{"x", "c"}); the empty path is
  /// this node. Throws KeyError naming the path and the keys available where it stopped.
  const Tree& at(const Path& path) const {
    auto& trail = detail::access_trail;  // continues a chain such as t["model"].at("enc.x")
    Path walked = trail.node == this ? std::move(trail.path) : Path{};
    trail.node = nullptr;
    const Tree* node = this;
    for (const auto& key : path) {
      node = node->child_or_throw(key, walked);
      walked.push_back(key);
    }
    trail.node = node;
    trail.path = std::move(walked);
    return *node;
  }
  const Tree& at(std::string_view dotted) const { return at(Path::parse(dotted)); }
  Tree& at(const Path& path) {
    drop_source();
    return const_cast<Tree&>(std::as_const(*this).at(path));
  }
  Tree& at(std::string_view dotted) { return at(Path::parse(dotted)); }

  /// Whether a node exists at the path (dotted or key sequence).
  bool contains(const Path& path) const { return find(path) != nullptr; }
  bool contains(std::string_view dotted) const { return contains(Path::parse(dotted)); }

  /// The child under `key`, or nullptr (also for a leaf): a binary search, no allocation.
  /// A deferred tree is made first (this may block and throw as make() does).
  const Tree* find_child(std::string_view key) const {
    if (is_leaf()) return nullptr;  // makes a deferred node
    const auto& c = std::get<0>(node_);
    auto it = std::lower_bound(c.begin(), c.end(), key,
                               [](const Entry& e, std::string_view k) { return e.first < k; });
    return it != c.end() && it->first == key ? &it->second : nullptr;
  }

  /// The node at the path, or nullptr.
  const Tree* find(const Path& path) const {
    const Tree* node = this;
    for (const auto& key : path) {
      node = node->find_child(key);
      if (!node) return nullptr;
    }
    return node;
  }

  /// Puts `value` at the path, replacing what was there and creating missing internal nodes.
  /// Throws KeyError when the path runs through a leaf, or is empty.
  Tree& insert(const Path& path, Tree value);
  Tree& insert(std::string_view dotted, Tree value) {
    return insert(Path::parse(dotted), std::move(value));
  }

  /// Removes the node at the path; returns whether there was one.
  bool erase(const Path& path);
  bool erase(std::string_view dotted) { return erase(Path::parse(dotted)); }

  /// Leaf paths in flatten (sorted, depth-first) order.
  std::vector<Path> paths() const;

  /// Structural and leaf equality (same keys, same shape, leaves equal with T's ==).
  friend bool operator==(const Tree& a, const Tree& b) requires std::equality_comparable<T> {
    return a.node() == b.node();
  }

 private:
  // Sorts by key through an index permutation: entries are moved once each, and GCC 12's
  // -Wmaybe-uninitialized false positive on std::sort swapping variants is avoided.
  static void sort_and_check(Children& entries) {
    auto by_key = [](const Entry& a, const Entry& b) { return a.first < b.first; };
    if (!std::is_sorted(entries.begin(), entries.end(), by_key)) {
      std::vector<std::size_t> order(entries.size());
      for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::sort(order.begin(), order.end(),
                [&](std::size_t a, std::size_t b) { return entries[a].first < entries[b].first; });
      Children sorted;
      sorted.reserve(entries.size());
      for (std::size_t i : order) sorted.push_back(std::move(entries[i]));
      entries = std::move(sorted);
    }
    auto dup =
        std::adjacent_find(entries.begin(), entries.end(),
                           [](const Entry& a, const Entry& b) { return a.first == b.first; });
    if (dup != entries.end())
      throw std::invalid_argument("duplicate tree key '" + dup->first + "'");
  }

  // The throws of leaf() and children(), kept out of line so that those two inline to a test.
  [[noreturn, gnu::cold, gnu::noinline]] void throw_not_leaf() const {
    throw StructureError(
        {}, "tree node is not a leaf (it has " + std::to_string(size()) + " children)");
  }
  [[noreturn, gnu::cold, gnu::noinline]] static void throw_leaf_has_no_children() {
    throw StructureError({}, "tree node is a leaf, it has no children");
  }

  std::vector<std::string> keys() const {
    std::vector<std::string> out;
    if (!is_leaf())
      for (const auto& e : std::get<0>(node_)) out.push_back(e.first);
    return out;
  }

  const Tree* child_or_throw(std::string_view key, const Path& walked) const {
    if (const Tree* c = find_child(key)) return c;
    Path full = walked / key;
    if (is_leaf())
      throw KeyError(full, {},
                     "no key '" + std::string(key) + "' at path '" + full.describe() + "': '" +
                         walked.describe() + "' is a leaf");
    throw KeyError(full, keys(),
                   "no key '" + std::string(key) + "' at path '" + full.describe() +
                       "'; available keys at '" + walked.describe() + "': " + format_keys(keys()));
  }

  // Plain recursive destruction is fastest; below this many levels a worklist takes over.
  static constexpr std::size_t kRecursionLimit = 256;

  [[gnu::noinline]] static void destroy_children(Children& children) noexcept {
    thread_local std::size_t levels = 0;  // destroy_children frames active on this thread
    if (levels >= kRecursionLimit) {
      dismantle(children);
      return;
    }
    ++levels;
    children.clear();
    --levels;
  }

  // Empties `children` through a worklist: every list of grandchildren is moved out before
  // its parent dies, so no destructor below runs on a node that still has children.
  static void dismantle(Children& children) noexcept {
    auto deep = [](const Entry& e) {
      const auto* c = std::get_if<0>(&e.second.node_);
      return c && !c->empty();
    };
    try {
      detail::WalkStack<Children> pending;
      pending.push(std::move(children));
      while (!pending.empty()) {
        Children level = std::move(pending.back());
        pending.pop();
        for (auto& e : level)
          if (deep(e)) pending.push(std::move(*std::get_if<0>(&e.second.node_)));
      }
    } catch (...) {
      // Out of memory for the worklist: what is left is destroyed recursively as the
      // worklist unwinds, which is only deep for pathological trees.
    }
  }

  // A deferred tree's source and whether node_ has been made from it (deferred()). A mutex,
  // not std::call_once: libstdc++'s call_once over pthread_once hangs the next caller after a
  // callable that threw, and make() may throw.
  struct Lazy {
    explicit Lazy(std::shared_ptr<const Source> s)
        : source(std::move(s)), pending(source && source->pending()) {}
    std::shared_ptr<const Source> source;
    const bool pending;
    std::shared_ptr<const Source> adopted;  // pending: the made tree's property (source())
    std::mutex mu;
    std::atomic<bool> made{false};
  };

  // node_, made first when this is a deferred tree. Every read of node_ goes through here.
  [[gnu::always_inline]] const std::variant<Children, T>& node() const {
    if (lazy_ && !lazy_->made.load(std::memory_order_acquire)) [[unlikely]]
      make();
    return node_;
  }
  [[gnu::noinline]] void make() const {
    std::lock_guard lock(lazy_->mu);
    if (lazy_->made.load(std::memory_order_relaxed)) return;
    Tree t = lazy_->source->make();
    if (lazy_->pending && t.lazy_) lazy_->adopted = t.lazy_->pending ? nullptr : t.lazy_->source;
    t.node();  // a deferred made tree (a consolidated result) makes its views now
    node_ = std::move(t.node_);
    lazy_->made.store(true, std::memory_order_release);
  }
  // A copy takes the content when it has been made, else the source alone (made again on the
  // copy's first access). The state is read once, so a concurrent first access of the original
  // is never seen half-done. A made pending tree's copy carries the adopted property only.
  enum class LazyState { none, pending, made };
  LazyState lazy_state() const noexcept {
    if (!lazy_) return LazyState::none;
    return lazy_->made.load(std::memory_order_acquire) ? LazyState::made : LazyState::pending;
  }
  Tree(const Tree& other, LazyState state)
      : node_(state == LazyState::pending ? std::variant<Children, T>() : other.node_) {
    if (state == LazyState::none) return;
    const Lazy& from = *other.lazy_;
    if (state == LazyState::made && from.pending) {
      if (from.adopted) lazy_ = std::make_unique<Lazy>(from.adopted);
    } else {
      lazy_ = std::make_unique<Lazy>(from.source);
    }
    if (lazy_) lazy_->made.store(state == LazyState::made, std::memory_order_relaxed);
  }
  // A mutation: make the content, then forget the source (the value no longer is its image).
  void drop_source() {
    if (!lazy_) return;
    node();
    lazy_.reset();
  }

  mutable std::variant<Children, T> node_;
  std::unique_ptr<Lazy> lazy_;
};

// ---- out-of-line members ------------------------------------------------------------------

template <class T>
std::size_t Tree<T>::depth() const {
  struct Frame {
    const Entry* it;
    const Entry* end;
  };
  if (is_leaf()) return 0;
  std::size_t d = 0;
  detail::WalkStack<Frame> stack;
  const auto& top = *std::get_if<0>(&node_);
  stack.push({top.data(), top.data() + top.size()});
  while (!stack.empty()) {
    Frame& f = stack.back();
    if (f.it == f.end) {
      stack.pop();
      continue;
    }
    const Tree& child = (f.it++)->second;
    d = std::max(d, stack.size());
    if (const auto* c = std::get_if<0>(&child.node()))
      stack.push({c->data(), c->data() + c->size()});
  }
  return d;
}

template <class T>
std::size_t Tree<T>::leaf_count() const {
  std::size_t n = 0;
  detail::WalkStack<const Tree*> stack;
  stack.push(this);
  while (!stack.empty()) {
    const Tree* node = stack.back();
    stack.pop();
    if (const auto* c = std::get_if<0>(&node->node()))
      for (const auto& e : *c) stack.push(&e.second);
    else
      ++n;
  }
  return n;
}

template <class T>
Tree<T>& Tree<T>::insert(const Path& path, Tree value) {
  if (path.empty()) throw KeyError(path, {}, "cannot insert at the root path");
  Tree* node = this;
  Path walked;
  for (std::size_t i = 0; i < path.size(); ++i) {
    node->drop_source();
    if (node->is_leaf())
      throw KeyError(
          path, {},
          "cannot insert at '" + path.describe() + "': '" + walked.describe() + "' is a leaf");
    auto& c = std::get<0>(node->node_);
    const std::string& key = path[i];
    auto it = std::lower_bound(c.begin(), c.end(), key,
                               [](const Entry& e, const std::string& k) { return e.first < k; });
    if (it == c.end() || it->first != key) it = c.emplace(it, key, Tree());
    if (i + 1 == path.size()) {
      it->second = std::move(value);
      return it->second;
    }
    node = &it->second;
    walked.push_back(key);
  }
  return *node;  // unreachable: the loop returns on the last key
}

template <class T>
bool Tree<T>::erase(const Path& path) {
  if (path.empty()) return false;
  Path parent_path(std::vector<std::string>(path.begin(), path.end() - 1));
  Tree* parent = this;  // every node on the way stops being its source's image
  for (const auto& key : parent_path) {
    parent->drop_source();
    parent = const_cast<Tree*>(parent->find_child(key));
    if (!parent) return false;
  }
  if (parent->is_leaf()) return false;
  parent->drop_source();
  auto& c = std::get<0>(parent->node_);
  auto it = std::lower_bound(c.begin(), c.end(), path.keys().back(),
                             [](const Entry& e, const std::string& k) { return e.first < k; });
  if (it == c.end() || it->first != path.keys().back()) return false;
  c.erase(it);
  return true;
}

template <class T>
std::vector<Path> Tree<T>::paths() const {
  struct Frame {
    const Entry* it;
    const Entry* end;
  };
  std::vector<Path> out;
  if (is_leaf()) {
    out.emplace_back();
    return out;
  }
  std::vector<std::string> prefix;
  detail::WalkStack<Frame> stack;
  const auto& top = *std::get_if<0>(&node_);
  stack.push({top.data(), top.data() + top.size()});
  while (!stack.empty()) {
    Frame& f = stack.back();
    if (f.it == f.end) {
      stack.pop();
      if (!prefix.empty()) prefix.pop_back();
      continue;
    }
    const auto& [key, child] = *f.it++;
    prefix.push_back(key);
    if (const auto* c = std::get_if<0>(&child.node())) {
      stack.push({c->data(), c->data() + c->size()});
    } else {
      out.emplace_back(prefix);
      prefix.pop_back();
    }
  }
  return out;
}

/// Upcasts a TreeLike argument (e.g. a TreeTensor) to its Tree<T> base.
template <TreeLike A>
const Tree<leaf_type_t<A>>& as_tree(const A& a) {
  return a;
}

}  // namespace treetensor::tree
