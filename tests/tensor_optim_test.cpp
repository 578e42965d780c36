// Adam over trees: the tree-op form and the foreach form equal a hand-written LibTorch loop
// bitwise on the CPU, under every execution strategy, over several steps.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>

#include "tensor_test_util.hpp"
#include "treetensor/tensor/tensor.hpp"

namespace tt = treetensor;
using namespace tt_test;
using tt::TreeTensor;

namespace {

class TensorAdam : public ::testing::TestWithParam<rt::StreamMode> {
 protected:
  static void SetUpTestSuite() { at::manual_seed(0); }
  rt::StreamGuard guard_{GetParam()};
};

// What a hand-written LibTorch optimizer does for one parameter (PyTorch's Adam arithmetic).
void native_adam(const at::Tensor& p, const at::Tensor& grad, const at::Tensor& m,
                 const at::Tensor& v, int64_t step, const tt::AdamOptions& o) {
  at::NoGradGuard no_grad;
  const at::Tensor g = o.weight_decay() != 0 ? grad.add(p, o.weight_decay()) : grad;
  m.mul_(o.beta1()).add_(g, 1 - o.beta1());
  v.mul_(o.beta2()).addcmul_(g, g, 1 - o.beta2());
  const double bc1 = 1 - std::pow(o.beta1(), static_cast<double>(step));
  const double bc2 = 1 - std::pow(o.beta2(), static_cast<double>(step));
  const at::Tensor denom = (v.sqrt() / std::sqrt(bc2)).add_(o.eps());
  p.addcdiv_(m, denom, -o.lr() / bc1);
}

struct State {
  TreeTensor p, g, m, v;
};

State make_state(const tt::ShapeTree& shapes) {
  State s;
  s.p = randn_tree(shapes);
  s.g = randn_tree(shapes);
  s.m = tt::zeros_like(s.p);
  s.v = tt::zeros_like(s.p);
  return s;
}

State copy(const State& s) {
  return {s.p.clone(), s.g.clone(), s.m.clone(), s.v.clone()};
}

}  // namespace

TEST_P(TensorAdam, BothFormsEqualTheNativeLoopBitwise) {
  const tt::ShapeTree shapes = {{"conv", {{"weight", {8, 3, 3, 3}}, {"bias", {8}}}},
                                {"fc", {{"weight", {10, 8}}, {"bias", {10}}}},
                                {"scale", tt::Shape{}}};
  const auto o = tt::AdamOptions().lr(1e-2).betas(0.8, 0.99).eps(1e-6).weight_decay(1e-3);
  const State init = make_state(shapes);
  State tree = copy(init), each = copy(init), ref = copy(init);
  const auto impls = leaves(tree.p);
  for (int64_t step = 1; step <= 4; ++step) {
    tt::adam_step(tree.p, tree.g, tree.m, tree.v, step, o);
    tt::adam_step_foreach(each.p, each.g, each.m, each.v, step, o);
    const auto p = leaves(ref.p), g = leaves(ref.g), m = leaves(ref.m), v = leaves(ref.v);
    for (std::size_t k = 0; k < p.size(); ++k) native_adam(p[k], g[k], m[k], v[k], step, o);
  }
  expect_same(tree.p, ref.p);
  expect_same(tree.m, ref.m);
  expect_same(tree.v, ref.v);
  expect_same(each.p, ref.p);
  expect_same(each.v, ref.v);
  for (std::size_t k = 0; k < impls.size(); ++k) EXPECT_TRUE(leaves(tree.p)[k].is_same(impls[k]));
  EXPECT_FALSE(tt::equal(tree.p, init.p));
}

TEST_P(TensorAdam, ParametersThatRequireGradAreUpdatedWithoutGraph) {
  State s = make_state({{"w", {4, 4}}, {"b", {4}}});
  tt::requires_grad_(s.p);
  tt::adam_step(s.p, s.g, s.m, s.v, 1);
  for (const auto& x : leaves(s.p)) {
    EXPECT_TRUE(x.requires_grad());
    EXPECT_TRUE(x.is_leaf());
  }
}

TEST(TensorAdamErrors, BadOptionsAndStructures) {
  State s = make_state({{"w", {2}}, {"b", {2}}});
  EXPECT_THROW(tt::adam_step(s.p, s.g, s.m, s.v, 0), std::invalid_argument);
  EXPECT_THROW(tt::adam_step(s.p, s.g, s.m, s.v, 1, tt::AdamOptions().betas(1.0, 0.9)),
               std::invalid_argument);
  EXPECT_THROW(tt::adam_step(s.p, s.g, s.m, s.v, 1, tt::AdamOptions().lr(-1)),
               std::invalid_argument);
  TreeTensor wrong{{"w", at::zeros({2})}};
  EXPECT_THROW(tt::adam_step(s.p, wrong, s.m, s.v, 1), tt::tree::StructureError);
  EXPECT_THROW(tt::adam_step_foreach(s.p, wrong, s.m, s.v, 1), tt::tree::StructureError);
}

INSTANTIATE_TEST_SUITE_P(Strategies, TensorAdam, ::testing::ValuesIn(strategies()), strategy_name);
