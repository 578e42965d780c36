// Adam over trees: the tree-op form and the foreach form equal a hand-written LibTorch loop
// bitwise on the CPU, under every execution strategy, over several steps.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <string>

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

// The message of what `f` throws as E (a failure when it throws nothing or something else).
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "nothing thrown";
  return {};
}

// Structure errors name the op the user called and its arguments by their signature's names
// (grads is zipped last inside, and was reported as "argument 3", or 4, under "zip:").
TEST(TensorAdamErrors, StructureErrorsNameTheOpAndTheArgument) {
  State s = make_state({{"w", {2}}, {"b", {2}}});
  TreeTensor wrong{{"w", at::zeros({2})}};
  using SE = tt::tree::StructureError;
  EXPECT_EQ(message_of<SE>([&] { tt::adam_step(s.p, wrong, s.m, s.v, 1); }),
            "adam_step: key mismatch at '<root>': params has keys {b, w}, grads has keys {w}");
  EXPECT_EQ(message_of<SE>([&] { tt::adam_step_single_pass(s.p, wrong, s.m, s.v, 1); }),
            "adam_step_single_pass: key mismatch at '<root>': params has keys {b, w}, grads has "
            "keys {w}");
  EXPECT_EQ(message_of<SE>([&] { tt::adam_step(s.p, s.g, s.m, wrong, 1); }),
            "adam_step: key mismatch at '<root>': params has keys {b, w}, exp_avg_sq has keys {w}");
  EXPECT_EQ(message_of<SE>([&] { tt::adam_step_foreach(s.p, wrong, s.m, s.v, 1); }),
            "adam_step_foreach: grads does not have the structure of params");
  EXPECT_EQ(
      message_of<SE>(
          [&] { tt::sgd_step_single_pass(s.p, s.g, wrong, 1, tt::SgdOptions(0.1).momentum(0.9)); }),
      "sgd_step_single_pass: key mismatch at '<root>': params has keys {b, w}, momentum_buffer "
      "has keys {w}");
}

// A float64 gradient for a float32 parameter: the dtype error naming the path, the expected
// and the given dtype, before any leaf is updated (ATen asserted "INTERNAL ASSERT FAILED" in
// the middle of the step, after other leaves were updated).
TEST(TensorAdamErrors, LeafMismatchesThrowBeforeAnyUpdate) {
  const State init = make_state({{"a", {3}}, {"b", {2}}});
  auto expect_untouched = [&](const State& s) {
    expect_same(s.p, init.p);
    expect_same(s.m, init.m);
    expect_same(s.v, init.v);
  };
  using IA = std::invalid_argument;
  State s = copy(init);
  s.g = TreeTensor{{"a", init.g.at("a").leaf()}, {"b", init.g.at("b").leaf().to(at::kDouble)}};
  EXPECT_EQ(message_of<IA>([&] { tt::adam_step(s.p, s.g, s.m, s.v, 1); }),
            "adam_step: at 'b': grads has dtype float64, expected float32 (the dtype of params)");
  expect_untouched(s);
  EXPECT_EQ(message_of<IA>([&] { tt::adam_step_single_pass(s.p, s.g, s.m, s.v, 1); }),
            "adam_step_single_pass: at 'b': grads has dtype float64, expected float32 (the dtype "
            "of params)");
  expect_untouched(s);
  EXPECT_EQ(message_of<IA>([&] { tt::adam_step_foreach(s.p, s.g, s.m, s.v, 1); }),
            "adam_step_foreach: at 'b': grads has dtype float64, expected float32 (the dtype of "
            "params)");
  expect_untouched(s);
  // Consolidated trees take the flat path first; it defers to the per-leaf check.
  State c{tt::consolidate(s.p), tt::consolidate(s.g), tt::consolidate(s.m), tt::consolidate(s.v)};
  EXPECT_EQ(message_of<IA>([&] { tt::adam_step(c.p, c.g, c.m, c.v, 1); }),
            "adam_step: at 'b': grads has dtype float64, expected float32 (the dtype of params)");
  expect_untouched(c);

  State shape = copy(init);
  shape.m = TreeTensor{{"a", at::zeros({3})}, {"b", at::zeros({2, 1})}};
  EXPECT_EQ(message_of<IA>([&] { tt::adam_step(shape.p, shape.g, shape.m, shape.v, 1); }),
            "adam_step: at 'b': exp_avg has shape [2, 1], expected [2] (the shape of params)");
  expect_same(shape.p, init.p);
}

// A single-pass step writes the parameters in place, so a leaf autograd saved must see the
// write: backward through it then raises, as after torch.optim's step. The consolidated path
// marks the buffers when the stepped tree's leaf views were never made (they share their
// buffer's version counter), and the leaves when they were.
TEST_P(TensorAdam, ASinglePassStepMovesTheVersionOfEveryLeafViewMadeOrNot) {
  for (const bool made : {false, true}) {
    for (const bool sgd : {false, true}) {
      SCOPED_TRACE(std::string(made ? "views made" : "views not made") +
                   (sgd ? ", sgd" : ", adam"));
      const State s = make_state({{"w", {4, 4}}, {"b", {4}}});
      State c{tt::consolidate(s.p), tt::consolidate(s.g), tt::consolidate(s.m),
              tt::consolidate(s.v)};
      const TreeTensor other = c.p;  // a copy: views of the same buffer, made on its own
      const at::Tensor w = other.at("w").leaf();
      if (made) (void)std::as_const(c.p).at("b").leaf();
      ASSERT_EQ(c.p.is_deferred(), !made);
      const at::Tensor a = at::ones({4, 4}).requires_grad_();
      const at::Tensor y = (a * w).sum();  // saves w for a's gradient
      const auto version = w._version();
      if (sgd)
        tt::sgd_step_single_pass(c.p, c.g, c.m, 1, tt::SgdOptions(0.1).momentum(0.9));
      else
        tt::adam_step_single_pass(c.p, c.g, c.m, c.v, 1);
      EXPECT_GT(w._version(), version);
      EXPECT_GT(other.at("b").leaf()._version(), version);
      EXPECT_NE(
          message_of<c10::Error>([&] { y.backward(); }).find("modified by an inplace operation"),
          std::string::npos);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, TensorAdam, ::testing::ValuesIn(strategies()), strategy_name);
