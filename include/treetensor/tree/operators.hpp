#pragma once
// Leaf-wise operators: a Tree<T> has the arithmetic, bitwise and ordering operators its leaf
// type has (treevalue parity). `==`/`!=` compare whole trees (see Tree::operator==).
//
// These apply to Tree<T> itself, not to classes derived from it: TreeTensor defines its own
// operators, which go through the runtime.

#include <type_traits>
#include <utility>

#include "treetensor/tree/core.hpp"
#include "treetensor/tree/zip.hpp"

namespace treetensor::tree {

namespace detail {
template <class A>
struct is_plain_tree : std::false_type {};
template <class T>
struct is_plain_tree<Tree<T>> : std::true_type {};

// A leaf-wise operand: a plain Tree<T>, or a non-tree value broadcast to every leaf.
template <class A>
concept Operand = is_plain_tree<std::decay_t<A>>::value || !TreeLike<A>;
template <class A, class B>
concept OperandPair = Operand<A> && Operand<B> &&
    (is_plain_tree<std::decay_t<A>>::value || is_plain_tree<std::decay_t<B>>::value);

template <class A>
struct leaf_or_self {
  using type = A;
};
template <class T>
struct leaf_or_self<Tree<T>> {
  using type = T;
};
template <class A>
using leaf_or_self_t = typename leaf_or_self<std::decay_t<A>>::type;
}  // namespace detail

#define TREETENSOR_TREE_BINARY_OP(op)                                                    \
  template <class A, class B>                                                            \
  requires detail::OperandPair<A, B> &&                                                  \
      requires(const detail::leaf_or_self_t<A>& x, const detail::leaf_or_self_t<B>& y) { \
    x op y;                                                                              \
  }                                                                                      \
  auto operator op(const A& a, const B& b) {                                             \
    return zip_map([](const auto& x, const auto& y) { return x op y; }, a, b);           \
  }

TREETENSOR_TREE_BINARY_OP(+)
TREETENSOR_TREE_BINARY_OP(-)
TREETENSOR_TREE_BINARY_OP(*)
TREETENSOR_TREE_BINARY_OP(/)
TREETENSOR_TREE_BINARY_OP(%)
TREETENSOR_TREE_BINARY_OP(&)
TREETENSOR_TREE_BINARY_OP(|)
TREETENSOR_TREE_BINARY_OP(^)
TREETENSOR_TREE_BINARY_OP(<<)
TREETENSOR_TREE_BINARY_OP(>>)
TREETENSOR_TREE_BINARY_OP(<)
TREETENSOR_TREE_BINARY_OP(<=)
TREETENSOR_TREE_BINARY_OP(>)
TREETENSOR_TREE_BINARY_OP(>=)
#undef TREETENSOR_TREE_BINARY_OP

#define TREETENSOR_TREE_UNARY_OP(op)                \
  template <class T>                                \
  requires requires(const T& x) {                   \
    op x;                                           \
  }                                                 \
  auto operator op(const Tree<T>& a) {              \
    return map([](const T& x) { return op x; }, a); \
  }

TREETENSOR_TREE_UNARY_OP(-)
TREETENSOR_TREE_UNARY_OP(+)
TREETENSOR_TREE_UNARY_OP(~)
TREETENSOR_TREE_UNARY_OP(!)
#undef TREETENSOR_TREE_UNARY_OP

#define TREETENSOR_TREE_COMPOUND_OP(op, binop)   \
  template <class T, class B>                    \
  requires requires(Tree<T> & a, const B& b) {   \
    a = a binop b;                               \
  }                                              \
  Tree<T>& operator op(Tree<T>& a, const B& b) { \
    a = a binop b;                               \
    return a;                                    \
  }

TREETENSOR_TREE_COMPOUND_OP(+=, +)
TREETENSOR_TREE_COMPOUND_OP(-=, -)
TREETENSOR_TREE_COMPOUND_OP(*=, *)
TREETENSOR_TREE_COMPOUND_OP(/=, /)
TREETENSOR_TREE_COMPOUND_OP(%=, %)
#undef TREETENSOR_TREE_COMPOUND_OP

}  // namespace treetensor::tree
