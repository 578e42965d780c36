// Fused tree expressions (DESIGN.md §19): fuse(f, trees...) gives, under every execution
// strategy, the values of f applied op at a time to the trees — bitwise for correctly rounded
// ops, within the libm bound (8 ulp, as tensor_flat_test derives it) for sigmoid — on leaves of
// different sizes, tile boundaries inside leaves, non-contiguous leaves, mixed dtypes,
// broadcast operands, consolidated trees; autograd, asyncs scopes and errors as tree calls.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "tensor_test_util.hpp"
#include "treetensor/asyncs/thread.hpp"
#include "treetensor/tensor/tensor.hpp"

namespace tt = treetensor;
namespace asyncs = treetensor::asyncs;
using namespace tt_test;
using tt::Expr;
using tt::FuseOptions;

namespace {

class Fuse : public ::testing::TestWithParam<rt::StreamMode> {
 protected:
  void SetUp() override { at::manual_seed(11); }
  rt::StreamGuard guard_{GetParam()};
};

// Leaves of 0, 1, 7, 1025 (a vector tail) and 40000 elements (three 64 KiB tiles, the last
// partial), a 2-D double leaf and a 0-d leaf (a 5-element one instead: flat execution runs
// trees with 0-d leaves per leaf when a tensor operand is 0-d).
TreeTensor mixed_sizes(bool zero_d_leaf = true) {
  return TreeTensor{{"a", at::randn({1025})},
                    {"b", TensorTree{{"x", at::randn({7})}, {"y", at::randn({0})}}},
                    {"c", at::randn({1})},
                    {"d", at::randn({3, 4}, at::kDouble)},
                    {"e", at::randn({40000})},
                    {"f", zero_d_leaf ? at::randn({}, at::kDouble) : at::randn({5}, at::kDouble)}};
}
TreeTensor like(const TensorTree& t) {
  return tt::tree::map([](const at::Tensor& x) { return at::randn_like(x); }, t);
}

// The workload's chain and a correctly rounded one (+, -, *, /, abs: bitwise everywhere).
const auto sigmoid_chain = [](const auto& x, const auto& y) { return (x * 2 + y).sigmoid_(); };
const auto rounded_chain = [](const auto& x, const auto& y) {
  auto t = x * 3 - y;
  t /= y.abs() + 1;
  return t.mul(0.5).add(x, -2);
};

}  // namespace

TEST_P(Fuse, ChainsEqualTheOpAtATimeTree) {
  const TreeTensor x = mixed_sizes(), y = like(x);
  expect_same(tt::fuse(rounded_chain, x, y), rounded_chain(x, y));
  expect_within_ulps(tt::fuse(sigmoid_chain, x, y), sigmoid_chain(x, y));
  // And the hand-written loop over the leaves with the same lambda on tensors.
  expect_same(
      tt::fuse(rounded_chain, x, y),
      native([](const at::Tensor& a, const at::Tensor& b) { return rounded_chain(a, b); }, x, y));
}

TEST_P(Fuse, TileBoundariesInsideLeaves) {
  const TreeTensor x = mixed_sizes(), y = like(x);
  // 256 bytes: 64-element tiles, so 1025 elements make 16 full tiles and a 1-element tail.
  for (std::int64_t bytes : {1, 256, 1000, 4096}) {
    SCOPED_TRACE(bytes);
    const FuseOptions o = FuseOptions().tile(bytes);
    expect_same(tt::fuse(o, rounded_chain, x, y), rounded_chain(x, y));
    expect_within_ulps(tt::fuse(o, sigmoid_chain, x, y), sigmoid_chain(x, y));
  }
  EXPECT_THROW(FuseOptions().tile(0), std::invalid_argument);
}

TEST_P(Fuse, ConsolidatedTreesRunOnTheBuffersAndStayConsolidated) {
  const TreeTensor qx = mixed_sizes(false), qy = like(qx);
  const TreeTensor cx = tt::consolidate(qx), cy = tt::consolidate(qy);
  for (std::int64_t bytes : {std::int64_t{64} << 10, std::int64_t{256}}) {
    SCOPED_TRACE(bytes);
    const FuseOptions o = FuseOptions().tile(bytes);
    const TreeTensor r = tt::fuse(o, rounded_chain, cx, cy);
    EXPECT_TRUE(tt::is_consolidated(r));
    EXPECT_TRUE(r.is_deferred()) << "no leaf view made by the call";
    expect_same(r, rounded_chain(qx, qy));
    expect_within_ulps(tt::fuse(o, sigmoid_chain, cx, cy), sigmoid_chain(qx, qy));
  }
}

TEST_P(Fuse, NonContiguousLeavesAndInLeafBroadcasting) {
  const TreeTensor x{{"t", at::randn({40, 300}).t()},  // transposed: runs whole, bitwise
                     {"s", at::randn({64, 9}).slice(1, 0, 9, 2)},
                     {"c", at::randn({6, 5})}};
  const TreeTensor y{{"t", at::randn({300, 40})},
                     {"s", at::randn({5})},  // broadcast against [64, 5]
                     {"c", at::randn({6, 5})}};
  expect_same(tt::fuse(rounded_chain, x, y), rounded_chain(x, y));
  expect_within_ulps(tt::fuse(sigmoid_chain, x, y), sigmoid_chain(x, y));
  const TreeTensor r = tt::fuse(FuseOptions().tile(64), rounded_chain, x, y);
  expect_same(r, rounded_chain(x, y));
  EXPECT_EQ(r.at("s").leaf().sizes(), (std::vector<int64_t>{64, 5}));
}

TEST_P(Fuse, BroadcastScalarsAndTensorsAndMixedDtypes) {
  const TreeTensor x = mixed_sizes(), y = like(x);
  const at::Tensor zero_d = at::scalar_tensor(1.25, at::kDouble);  // promotes nothing (0-d)
  const at::Tensor row = at::randn({7});
  auto with_scalars = [&](const auto& a, const auto& b) { return (2 - a) * b + zero_d / 3; };
  expect_same(tt::fuse(FuseOptions().tile(256), with_scalars, x, y), with_scalars(x, y));
  // A tensor argument broadcast to every leaf, as in any tree call.
  const TreeTensor b7{{"p", at::randn({3, 7})}, {"q", at::randn({7})}};
  expect_same(tt::fuse([](const auto& a, const auto& r) { return a * r + 1; }, b7, row),
              b7 * row + 1);
  // Mixed dtypes across arguments and leaves: torch's promotion, leaf by leaf.
  const TreeTensor xf{{"a", at::randn({300})}, {"b", at::randint(-5, 5, {300})}};
  const TreeTensor yd{{"a", at::randn({300}, at::kDouble)}, {"b", at::randint(1, 5, {300})}};
  const auto divided = [](const auto& a, const auto& b) { return (a * 3 - b) / (b.abs() + 1); };
  const TreeTensor r = tt::fuse(FuseOptions().tile(256), divided, xf, yd);
  EXPECT_EQ(r.at("a").leaf().scalar_type(), at::kDouble);
  EXPECT_EQ(r.at("b").leaf().scalar_type(), at::kFloat);  // int / (int + 1): true division
  expect_same(r, divided(xf, yd));
  const auto int_chain = [](const auto& a, const auto& b) { return (a * 3 + b).remainder(4); };
  expect_same(tt::fuse(FuseOptions().tile(256), int_chain, xf, yd), int_chain(xf, yd));
}

TEST_P(Fuse, InPlaceOpsFollowEagerAliasing) {
  const TreeTensor x = mixed_sizes(), y = like(x);
  // u is a copy of t (one tensor): t's in-place add is seen through u, as with at::Tensor.
  auto aliasing = [](const auto& a, const auto& b) {
    auto t = a * 2;
    auto u = t;
    auto before = t + b;  // read before the in-place op: the old value
    t.add_(1).sigmoid_();
    return u * before;
  };
  expect_within_ulps(tt::fuse(FuseOptions().tile(256), aliasing, x, y), aliasing(x, y));
  // In place on an argument or a broadcast tensor: refused when written.
  EXPECT_THROW(tt::fuse([](Expr a) { return a.sigmoid_(); }, x), std::invalid_argument);
  try {
    tt::fuse([](Expr a, const Expr& b) { return a.mul_(b); }, x, y);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("mul_ in place on argument 0 of fuse()"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(tt::fuse([](const Expr& a) { return a.detach(); }, x), std::invalid_argument);
  // The identity gives back the argument's tensors.
  const TreeTensor same = tt::fuse([](const Expr& a) { return a; }, x);
  EXPECT_TRUE(same.at("a").leaf().is_same(x.at("a").leaf()));
}

TEST_P(Fuse, ErrorsNameTheLeafAndTheStep) {
  const TreeTensor x{{"a", at::randn({4})}, {"n", TensorTree{{"i", at::randn({3})}}}};
  const TreeTensor other{{"a", at::randn({4})}, {"m", at::randn({3})}};
  try {
    tt::fuse([](const auto& a) { return (a + 1).bitwise_and(3); }, x);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    const std::string m = e.what_without_backtrace();
    EXPECT_NE(m.find("fuse(add, bitwise_and) at leaf 'a': bitwise_and (step 2 of 2): "),
              std::string::npos)
        << m;
  }
  EXPECT_THROW(tt::fuse(sigmoid_chain, x, other), tt::tree::StructureError);
  EXPECT_THROW(tt::fuse(sigmoid_chain, x, 2.0), std::invalid_argument);  // a number argument
  EXPECT_THROW(tt::fuse([](const Expr& a) { return a + 1; }, at::ones({2})),
               std::invalid_argument);  // no tree
  // A shape mismatch inside a leaf: torch's error with the path.
  const TreeTensor y{{"a", at::randn({5})}, {"n", TensorTree{{"i", at::randn({3})}}}};
  try {
    tt::fuse(sigmoid_chain, x, y);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("at leaf 'a': add (step 2 of 3)"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST_P(Fuse, AutogradRunsEachLeafWholeWithTheOpAtATimeGraph) {
  const TreeTensor x0 = mixed_sizes(), y = like(x0);
  auto leaf_copy = [](const TensorTree& t) {
    TreeTensor c = tt::tree::map([](const at::Tensor& v) { return v.detach().clone(); }, t);
    c.requires_grad_();
    return c;
  };
  TreeTensor a = leaf_copy(x0), b = leaf_copy(x0);
  const TreeTensor fused = tt::fuse(FuseOptions().tile(256), sigmoid_chain, a, y);
  const TreeTensor eager = sigmoid_chain(b, y);
  expect_same(fused, eager);  // whole leaves: the very kernels of the eager chain
  for (const auto& l : leaves(fused)) EXPECT_TRUE(l.requires_grad());
  auto total = [](const TensorTree& t) {
    at::Tensor s = at::zeros({}, at::kDouble);
    for (const auto& l : leaves(t)) s = s + l.sum().to(at::kDouble);
    return s;
  };
  total(fused).backward();
  total(eager).backward();
  expect_same(a.grad(), b.grad());
}

TEST_P(Fuse, RunsInsideAnAsyncsScope) {
  const TreeTensor x = mixed_sizes(), y = like(x);
  asyncs::Thread worker("fuse");
  TreeTensor r;
  {
    asyncs::ThreadScope scope(worker);
    r = tt::fuse(rounded_chain, x, y);
  }
  expect_same(r, rounded_chain(x, y));
}

INSTANTIATE_TEST_SUITE_P(Strategies, Fuse, ::testing::ValuesIn(strategies()), strategy_name);
