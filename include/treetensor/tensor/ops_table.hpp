#pragma once
// The op table: one list per op shape, expanded by X-macros into the free functions and the
// TreeTensor methods (declarations in the headers, definitions in src/tensor/ops.cpp) and into
// the tests that check each op against a hand-written loop over at:: calls. Add an op here and
// it exists everywhere. Every name is an ATen function present in LibTorch 1.13 and 2.x.
//
// The lists hold names only; the shapes are:
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
  X(abs) X(ceil) X(floor) X(round) X(trunc) X(frac) X(sigmoid) X(sqrt) X(rsqrt) X(square)      \
  X(exp) X(exp2) X(expm1) X(log) X(log1p) X(log2) X(log10) X(neg) X(sign) X(reciprocal)        \
  X(sin) X(cos) X(tan) X(tanh) X(sinh) X(cosh) X(asin) X(acos) X(atan) X(erf) X(erfc)          \
  X(erfinv) X(relu) X(logical_not) X(bitwise_not) X(detach)

// f(t): at::f(leaf). Results of the predicates are bool tensors.
#define TREETENSOR_UNARY_OPS(X) X(isfinite) X(isinf) X(isnan) X(signbit) X(clone)

// f(a, b) and f_(a, b): at::f(a, b) / a.f_(b), with the Tensor-Scalar overload for scalar b.
// The comparisons return bool tensors (their in-place forms write 0/1 in a's dtype, as torch).
#define TREETENSOR_BINARY_SCALAR_OPS(X)                                                        \
  X(mul) X(div) X(remainder) X(fmod) X(pow) X(eq) X(ne) X(lt) X(le) X(gt) X(ge)                \
  X(bitwise_and) X(bitwise_or) X(bitwise_xor)

// f(a, b): at::f(a, b) on tensors.
#define TREETENSOR_BINARY_TENSOR_OPS(X)                                                        \
  X(atan2) X(maximum) X(minimum) X(logical_and) X(logical_or) X(logical_xor)
// clang-format on
