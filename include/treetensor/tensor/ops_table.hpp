#pragma once
// The op table: one list per op shape, expanded by X-macros into the free functions and the
// TreeTensor methods (definitions in src/tensor/ops.cpp) and into the tests that check each op
// against a hand-written loop over at:: calls. Add an op here (and run
// scripts/gen_ops_header.py, which writes its declaration and doc into ops_generated.hpp; ctest
// fails while that file is stale) and it exists everywhere. Every name is an ATen function
// present in LibTorch 1.13 and 2.x.
//
// Each entry is X(name, fused, "doc"):
//  - fused: `foreach` when at::_foreach_<name> (and _foreach_<name>_) exist in LibTorch 1.13
//    and 2.x — stream(fused) then runs the call as one such kernel (DESIGN.md §9) — else `none`;
//  - doc: what the op computes on each leaf, the line the generated declaration carries.
// The shapes are:
//  - UNARY_INPLACE   f(t) -> tree,  f_(t) in place       (DI-treetensor's math functions)
//  - UNARY           f(t) -> tree, no in-place form     (predicates and copies)
//  - BINARY_SCALAR   f(a, b) -> tree, f_(a, b) in place; at::f has a Tensor-Scalar overload,
//                    used when b is a scalar
//  - BINARY_TENSOR   f(a, b) -> tree; at::f takes tensors only (a scalar operand is passed as
//                    a wrapped-number tensor, which type promotion treats like a scalar)

// clang-format 14 does not converge on these name tables.
// clang-format off
// f(t) and f_(t): at::f(leaf), leaf.f_().
#define TREETENSOR_UNARY_INPLACE_OPS(X)                                                        \
  X(abs, foreach, "absolute value |x|")                                                        \
  X(ceil, foreach, "smallest integer >= x")                                                    \
  X(floor, foreach, "largest integer <= x")                                                    \
  X(round, foreach, "nearest integer, halves to even")                                         \
  X(trunc, foreach, "integer part, rounded towards zero")                                      \
  X(frac, foreach, "fractional part x - trunc(x)")                                             \
  X(sigmoid, foreach, "logistic function 1 / (1 + exp(-x))")                                   \
  X(sqrt, foreach, "square root")                                                              \
  X(rsqrt, none, "reciprocal square root 1 / sqrt(x)")                                         \
  X(square, none, "x * x")                                                                     \
  X(exp, foreach, "e^x")                                                                       \
  X(exp2, none, "2^x")                                                                         \
  X(expm1, none, "e^x - 1, exact for small x")                                                 \
  X(log, foreach, "natural logarithm")                                                         \
  X(log1p, none, "log(1 + x), exact for small x")                                              \
  X(log2, none, "base-2 logarithm")                                                            \
  X(log10, none, "base-10 logarithm")                                                          \
  X(neg, foreach, "-x")                                                                        \
  X(sign, none, "-1, 0 or 1 by the sign of x")                                                 \
  X(reciprocal, foreach, "1 / x")                                                              \
  X(sin, foreach, "sine (radians)")                                                            \
  X(cos, foreach, "cosine (radians)")                                                          \
  X(tan, foreach, "tangent (radians)")                                                         \
  X(tanh, foreach, "hyperbolic tangent")                                                       \
  X(sinh, foreach, "hyperbolic sine")                                                          \
  X(cosh, foreach, "hyperbolic cosine")                                                        \
  X(asin, foreach, "arcsine")                                                                  \
  X(acos, foreach, "arccosine")                                                                \
  X(atan, foreach, "arctangent")                                                               \
  X(erf, foreach, "error function")                                                            \
  X(erfc, foreach, "complementary error function 1 - erf(x)")                                  \
  X(erfinv, none, "inverse error function")                                                    \
  X(relu, none, "max(x, 0)")                                                                   \
  X(logical_not, none, "!x (bool; in place: 0/1 in the dtype of x)")                           \
  X(bitwise_not, none, "~x on integer and bool tensors")                                       \
  X(detach, none, "x cut from the autograd graph (same data)")

// f(t): at::f(leaf). Results of the predicates are bool tensors.
#define TREETENSOR_UNARY_OPS(X)                                                                \
  X(isfinite, none, "whether x is finite (bool)")                                              \
  X(isinf, none, "whether x is +-infinity (bool)")                                             \
  X(isnan, none, "whether x is NaN (bool)")                                                    \
  X(signbit, none, "whether the sign bit of x is set, -0.0 included (bool)")                   \
  X(clone, none, "a copy of x with its own storage")

// f(a, b) and f_(a, b): at::f(a, b) / a.f_(b), with the Tensor-Scalar overload for scalar b.
// The comparisons return bool tensors (their in-place forms write 0/1 in a's dtype, as torch).
#define TREETENSOR_BINARY_SCALAR_OPS(X)                                                        \
  X(mul, foreach, "a * b")                                                                     \
  X(div, foreach, "a / b (true division)")                                                     \
  X(remainder, none, "a mod b with the sign of b (Python's %)")                                \
  X(fmod, none, "a mod b with the sign of a (C's fmod)")                                       \
  X(pow, none, "a^b")                                                                          \
  X(eq, none, "a == b (bool)")                                                                 \
  X(ne, none, "a != b (bool)")                                                                 \
  X(lt, none, "a < b (bool)")                                                                  \
  X(le, none, "a <= b (bool)")                                                                 \
  X(gt, none, "a > b (bool)")                                                                  \
  X(ge, none, "a >= b (bool)")                                                                 \
  X(bitwise_and, none, "a & b on integer and bool tensors")                                    \
  X(bitwise_or, none, "a | b on integer and bool tensors")                                     \
  X(bitwise_xor, none, "a ^ b on integer and bool tensors")

// f(a, b): at::f(a, b) on tensors.
#define TREETENSOR_BINARY_TENSOR_OPS(X)                                                        \
  X(atan2, none, "arctangent of a / b in the quadrant of (b, a)")                              \
  X(maximum, none, "element-wise max(a, b), NaN-propagating")                                  \
  X(minimum, none, "element-wise min(a, b), NaN-propagating")                                  \
  X(logical_and, none, "a && b (bool)")                                                        \
  X(logical_or, none, "a || b (bool)")                                                         \
  X(logical_xor, none, "a != b as truth values (bool)")
// clang-format on
