#pragma once
// The op table (ops_table.hpp) as test cases: each op's tree forms beside the at:: calls a
// hand-written loop makes, shared by the tests that check every op (per leaf and flat).

#include <ATen/ATen.h>

#include <vector>

#include "treetensor/tensor/tensor.hpp"

namespace tt_test {

namespace tt = treetensor;
using treetensor::TreeTensor;

struct UnaryCase {
  const char* name;
  TreeTensor (*tree)(const tt::TensorTree&);
  TreeTensor& (*tree_)(TreeTensor&);
  at::Tensor (*native)(const at::Tensor&);
  void (*native_)(const at::Tensor&);
};
#define TT_UNARY_CASE(n, ...)                                         \
  UnaryCase{#n, [](const tt::TensorTree& t) { return tt::n(t); },     \
            [](TreeTensor& t) -> TreeTensor& { return tt::n##_(t); }, \
            [](const at::Tensor& x) { return at::n(x); }, [](const at::Tensor& x) { x.n##_(); }},
const std::vector<UnaryCase> unary_cases = {TREETENSOR_UNARY_INPLACE_OPS(TT_UNARY_CASE)};
#undef TT_UNARY_CASE

struct PlainUnaryCase {
  const char* name;
  TreeTensor (*tree)(const tt::TensorTree&);
  at::Tensor (*native)(const at::Tensor&);
};
#define TT_PLAIN_UNARY_CASE(n, ...)                                    \
  PlainUnaryCase{#n, [](const tt::TensorTree& t) { return tt::n(t); }, \
                 [](const at::Tensor& x) { return at::n(x); }},
const std::vector<PlainUnaryCase> plain_unary_cases = {TREETENSOR_UNARY_OPS(TT_PLAIN_UNARY_CASE)};
#undef TT_PLAIN_UNARY_CASE

struct BinaryCase {
  const char* name;
  TreeTensor (*tree)(const tt::Operand&, const tt::Operand&);
  TreeTensor& (*tree_)(TreeTensor&, const tt::Operand&);
  at::Tensor (*tt_)(const at::Tensor&, const at::Tensor&);
  at::Tensor (*ts_)(const at::Tensor&, const at::Scalar&);
  void (*inplace_tt)(const at::Tensor&, const at::Tensor&);
  void (*inplace_ts)(const at::Tensor&, const at::Scalar&);
};
#define TT_BINARY_CASE(n, ...)                                                                  \
  BinaryCase{#n,                                                                                \
             [](const tt::Operand& a, const tt::Operand& b) { return tt::n(a, b); },            \
             [](TreeTensor& a, const tt::Operand& b) -> TreeTensor& { return tt::n##_(a, b); }, \
             [](const at::Tensor& x, const at::Tensor& y) { return at::n(x, y); },              \
             [](const at::Tensor& x, const at::Scalar& y) { return at::n(x, y); },              \
             [](const at::Tensor& x, const at::Tensor& y) { x.n##_(y); },                       \
             [](const at::Tensor& x, const at::Scalar& y) { x.n##_(y); }},
const std::vector<BinaryCase> binary_cases = {TREETENSOR_BINARY_SCALAR_OPS(TT_BINARY_CASE)};
#undef TT_BINARY_CASE

struct TensorBinaryCase {
  const char* name;
  TreeTensor (*tree)(const tt::Operand&, const tt::Operand&);
  at::Tensor (*native)(const at::Tensor&, const at::Tensor&);
};
#define TT_TBINARY_CASE(n, ...)                                                                \
  TensorBinaryCase{#n, [](const tt::Operand& a, const tt::Operand& b) { return tt::n(a, b); }, \
                   [](const at::Tensor& x, const at::Tensor& y) { return at::n(x, y); }},
const std::vector<TensorBinaryCase> tensor_binary_cases = {
    TREETENSOR_BINARY_TENSOR_OPS(TT_TBINARY_CASE)};
#undef TT_TBINARY_CASE

}  // namespace tt_test
