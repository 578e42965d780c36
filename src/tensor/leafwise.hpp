#pragma once
// Shorthands for the common op shape "one tree, one leaf function with captured arguments",
// shared by the op sources. Internal (src/ only).

#include <string_view>
#include <utility>
#include <vector>

#include "treetensor/tensor/dispatch.hpp"

namespace treetensor::detail {

/// pred(leaf) on the leaves of t in flatten order (sorted keys, depth first) until it returns
/// false; whether every call returned true. Iterative, builds no spec (flatten_refs does), and
/// allocates nothing for trees of up to 32 pending nodes.
template <class P>
bool all_leaves(const TensorTree& t, P&& pred) {
  tree::detail::WalkStack<const TensorTree*> stack;
  stack.push(&t);
  while (!stack.empty()) {
    const TensorTree* n = stack.back();
    stack.pop();
    if (n->is_leaf()) {
      if (!pred(n->leaf())) return false;
      continue;
    }
    const auto& children = n->children();
    for (auto it = children.rbegin(); it != children.rend(); ++it) stack.push(&it->second);
  }
  return true;
}

/// f(leaf) on every leaf of t, through the runtime.
template <class F>
TreeTensor map1(const CallOptions& o, const TensorTree& t, F&& f) {
  const Operand args[] = {Operand(t)};
  return map_leaves(o, args, [&](const LeafArgs& x) { return f(x.t(0)); });
}
template <class F>
TreeTensor map1(std::string_view op, const TensorTree& t, F&& f) {
  return map1(CallOptions{op}, t, std::forward<F>(f));
}

/// f(leaf) for its side effect on every leaf of t (in place), through the runtime.
template <class F>
TreeTensor& update1(const CallOptions& o, TreeTensor& t, F&& f) {
  const Operand args[] = {Operand(t)};
  update_leaves(o, args, [&](const LeafArgs& x) { f(x.t(0)); });
  return t;
}
template <class F>
TreeTensor& update1(std::string_view op, TreeTensor& t, F&& f) {
  return update1(CallOptions{op}, t, std::forward<F>(f));
}

/// Options of an elementwise, shape-preserving op (it may run flat on consolidated trees).
inline CallOptions elementwise(std::string_view op) {
  CallOptions o{op};
  o.elementwise = true;
  return o;
}

/// elementwise(op) that consolidated integer buffers also run flat (CallOptions::integer_safe).
inline CallOptions integer_safe(std::string_view op) {
  CallOptions o = elementwise(op);
  o.integer_safe = true;
  return o;
}

/// f(leaf) -> several tensors on every leaf of t; result k is the tree of the k-th tensors.
template <class F>
std::vector<TreeTensor> multi1(std::string_view op, const TensorTree& t, F&& f) {
  const Operand args[] = {Operand(t)};
  return map_leaves_multi(CallOptions{op}, args, [&](const LeafArgs& x) { return f(x.t(0)); });
}

}  // namespace treetensor::detail
