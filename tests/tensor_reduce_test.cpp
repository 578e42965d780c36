// Reductions (DESIGN.md §4) and autograd through tree ops, with issue 3's values, under every
// execution strategy; non-contiguous leaves; empty trees.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "tensor_test_util.hpp"
#include "treetensor/tensor/tensor.hpp"

namespace tt = treetensor;
using namespace tt_test;
using tt::TreeTensor;

namespace {

class TensorReduce : public ::testing::TestWithParam<rt::StreamMode> {
 protected:
  static void SetUpTestSuite() { at::manual_seed(0); }
  rt::StreamGuard guard_{GetParam()};
};

at::Tensor bools(std::vector<int> v) {
  return at::tensor(v).to(at::kBool);
}

TreeTensor issue_sum_tree() {
  return TreeTensor{{"a", at::tensor({1.0f, 2.0f, 1.5f})},
                    {"b", TensorTree{{"x", at::tensor({1.8f, 0.9f, 1.3f, 2.5f}).view({2, 2})}}}};
}

TreeTensor issue_mean_tree(bool requires_grad) {
  return TreeTensor{{"a", at::tensor({2.0f, 3.0f, 4.0f}).requires_grad_(requires_grad)},
                    {"b", TensorTree{{"x", at::tensor({5.0f, 6.0f, 7.0f, 8.0f})
                                               .view({2, 2})
                                               .detach()
                                               .requires_grad_(requires_grad)}}}};
}

// All elements of all leaves as one flat tensor: the reference for tree-level reductions.
at::Tensor all_elements(const TensorTree& t) {
  std::vector<at::Tensor> flat;
  for (const auto& x : leaves(t)) flat.push_back(x.reshape({-1}).to(at::kDouble));
  return at::cat(flat);
}

}  // namespace

TEST_P(TensorReduce, IssueValues) {
  TreeTensor b{{"a", bools({1, 1, 1})}, {"b", bools({1, 1, 0})}};
  EXPECT_FALSE(tt::all(b).item<bool>());
  EXPECT_TRUE(tt::any(b).item<bool>());
  EXPECT_FLOAT_EQ(tt::sum(issue_sum_tree()).item<float>(), 11.0f);
  EXPECT_FLOAT_EQ(tt::mean(issue_mean_tree(false)).item<float>(), 5.0f);

  TreeTensor per_leaf = tt::leaf_sum(issue_sum_tree());
  EXPECT_FLOAT_EQ(per_leaf.at("a").leaf().item<float>(), 4.5f);
  EXPECT_FLOAT_EQ(per_leaf.at("b.x").leaf().item<float>(), 6.5f);
  TreeTensor dim0 = tt::leaf_sum(issue_sum_tree(), {0});
  EXPECT_FLOAT_EQ(dim0.at("a").leaf().item<float>(), 4.5f);
  EXPECT_TRUE(at::allclose(dim0.at("b.x").leaf(), at::tensor({3.1f, 3.4f})));
}

TEST_P(TensorReduce, TreeLevelEqualsReductionOfAllElements) {
  TreeTensor t =
      randn_tree({{"a", {4, 5}}, {"b", {{"x", {7}}, {"y", tt::Shape{}}}}, {"e", {0, 3}}});
  t.insert("d", TensorTree(at::randn({3, 3}, at::kDouble)));
  const at::Tensor all = all_elements(t);
  EXPECT_NEAR(tt::sum(t).item<double>(), all.sum().item<double>(), 1e-4);
  EXPECT_NEAR(tt::mean(t).item<double>(), all.mean().item<double>(), 1e-5);
  EXPECT_NEAR(tt::std(t).item<double>(), all.std().item<double>(), 1e-5);
  EXPECT_NEAR(tt::std(t, false).item<double>(), all.std(false).item<double>(), 1e-5);
  EXPECT_NEAR(tt::norm(t).item<double>(), all.norm().item<double>(), 1e-4);
  EXPECT_NEAR(tt::norm(t, 1).item<double>(), all.norm(1).item<double>(), 1e-3);
  EXPECT_DOUBLE_EQ(tt::min(t).item<double>(), all.min().item<double>());
  EXPECT_DOUBLE_EQ(tt::max(t).item<double>(), all.max().item<double>());
  EXPECT_EQ(tt::sum(t).scalar_type(), at::kDouble) << "float + double leaves promote";
  EXPECT_TRUE(t.sum().equal(tt::sum(t)));
  EXPECT_EQ(tt::all(t > -100).item<bool>(), true);
  EXPECT_EQ(tt::any(t > 100).item<bool>(), false);
  TreeTensor ints = tt::randint(0, 5, {{"p", {3}}, {"q", {2, 2}}});
  EXPECT_EQ(tt::sum(ints).scalar_type(), at::kLong);
  EXPECT_EQ(tt::sum(ints).item<int64_t>(), all_elements(ints).sum().item<double>());
  EXPECT_THROW(tt::mean(ints), std::invalid_argument);
}

TEST_P(TensorReduce, NonContiguousLeaves) {
  TreeTensor base = randn_tree({{"a", {6, 4}}, {"b", {{"x", {5, 8}}}}});
  TreeTensor t = tt::transpose(base, 0, 1);
  t = tt::index(t, {at::indexing::Slice(), at::indexing::Slice(0, at::indexing::None, 2)});
  for (const auto& x : leaves(t)) ASSERT_FALSE(x.is_contiguous());
  EXPECT_NEAR(tt::sum(t).item<double>(), all_elements(t).sum().item<double>(), 1e-4);
  EXPECT_NEAR(tt::mean(t).item<double>(), all_elements(t).mean().item<double>(), 1e-5);
  expect_same(tt::leaf_mean(t, {1}), native([](auto& x) { return x.mean({1}); }, t));
}

TEST_P(TensorReduce, EmptyTreesAndTreesWithoutElements) {
  const TreeTensor none;
  EXPECT_EQ(tt::sum(none).item<int64_t>(), 0);
  EXPECT_TRUE(std::isnan(tt::mean(none).item<double>()));
  EXPECT_TRUE(tt::all(none).item<bool>());
  EXPECT_FALSE(tt::any(none).item<bool>());
  EXPECT_EQ(tt::norm(none).item<double>(), 0.0);
  EXPECT_TRUE(std::isnan(tt::std(none).item<double>()));
  EXPECT_THROW(tt::min(none), std::invalid_argument);
  EXPECT_THROW(tt::max(none), std::invalid_argument);
  EXPECT_EQ(tt::masked_select(none, none).numel(), 0);
  EXPECT_TRUE(tt::leaf_sum(none).empty());

  TreeTensor hollow{{"a", at::zeros({0})}, {"b", at::zeros({2, 0})}};
  EXPECT_EQ(tt::sum(hollow).item<float>(), 0.0f);
  EXPECT_TRUE(std::isnan(tt::mean(hollow).item<float>()));
  try {
    tt::max(hollow);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "max: the tree has no elements (2 leaves)");
  }
  // Empty leaves contribute nothing to min/max.
  TreeTensor some{{"a", at::zeros({0})}, {"b", at::tensor({3.0f, -1.0f})}};
  EXPECT_EQ(tt::min(some).item<float>(), -1.0f);
}

TEST_P(TensorReduce, PerLeafFormsMatchNativeLoop) {
  TreeTensor t = randn_tree({{"a", {4, 5}}, {"b", {{"x", {3, 6}}}}});
  expect_same(tt::leaf_sum(t), native([](auto& x) { return x.sum(); }, t));
  expect_same(tt::leaf_sum(t, {0, 1}, true), native(
                                                 [](auto& x) {
                                                   return x.sum(at::IntArrayRef{0, 1}, true);
                                                 },
                                                 t));
  expect_same(tt::leaf_mean(t), native([](auto& x) { return x.mean(); }, t));
  expect_same(tt::leaf_std(t), native([](auto& x) { return x.std(); }, t));
  expect_same(tt::leaf_std(t, {1}, false, true),
              native([](auto& x) { return x.std({1}, false, true); }, t));
  expect_same(tt::leaf_norm(t, 3), native([](auto& x) { return x.norm(3); }, t));
  expect_same(tt::leaf_min(t), native([](auto& x) { return x.min(); }, t));
  expect_same(tt::leaf_max(t), native([](auto& x) { return x.max(); }, t));
  TreeTensor m = t > 0;
  expect_same(tt::leaf_all(m), native([](auto& x) { return x.all(); }, m));
  expect_same(tt::leaf_any(m, 1), native([](auto& x) { return x.any(1); }, m));
  expect_same(tt::leaf_all(m, 0, true), native([](auto& x) { return x.all(0, true); }, m));
  auto [v, i] = tt::leaf_min(t, 1);
  expect_same(v, native([](auto& x) { return std::get<0>(x.min(1)); }, t));
  expect_same(i, native([](auto& x) { return std::get<1>(x.min(1)); }, t));
  auto [mv, mi] = tt::leaf_max(t, 0, true);
  expect_same(mv, native([](auto& x) { return std::get<0>(x.max(0, true)); }, t));
  expect_same(mi, native([](auto& x) { return std::get<1>(x.max(0, true)); }, t));
  expect_same(tt::leaf_masked_select(t, m),
              native([](auto& x, auto& k) { return x.masked_select(k); }, t, m));
  std::vector<at::Tensor> parts;
  for (const auto& [x, k] : std::vector<std::pair<at::Tensor, at::Tensor>>{
           {t.at("a").leaf(), m.at("a").leaf()}, {t.at("b.x").leaf(), m.at("b.x").leaf()}})
    parts.push_back(x.masked_select(k));
  EXPECT_TRUE(at::equal(tt::masked_select(t, m), at::cat(parts)));
}

TEST_P(TensorReduce, GradientOfSquaredTreeMeanIsTenSevenths) {
  TreeTensor t = issue_mean_tree(true);
  at::Tensor loss = tt::mean(t).pow(2);
  loss.backward();
  TreeTensor g = t.grad();
  for (const auto& x : leaves(g)) EXPECT_TRUE(at::allclose(x, at::full_like(x, 10.0 / 7.0)));
  EXPECT_EQ(g.shape(), t.shape());
}

TEST_P(TensorReduce, GradientsFlowThroughTreeOps) {
  TreeTensor w =
      tt::randn({{"a", {3, 4}}, {"b", {{"x", {4, 2}}}}}, at::TensorOptions().requires_grad(true));
  TreeTensor x = randn_tree({{"a", {2, 3}}, {"b", {{"x", {5, 4}}}}});
  at::Tensor loss = tt::sum(tt::sigmoid(tt::matmul(x, w)) * 2 + 1);
  loss.backward();
  for (const auto& p : w.paths()) {
    const at::Tensor wl = w.at(p).leaf().detach().requires_grad_(true);
    const at::Tensor xl = x.at(p).leaf();
    (at::sigmoid(at::matmul(xl, wl)) * 2 + 1).sum().backward();
    EXPECT_TRUE(at::allclose(w.grad().at(p).leaf(), wl.grad(), 1e-5, 1e-6)) << p.str();
  }
  at::NoGradGuard no_grad;
  EXPECT_FALSE(tt::single((w * 2).requires_grad()));
}

INSTANTIATE_TEST_SUITE_P(Strategies, TensorReduce, ::testing::ValuesIn(strategies()),
                         strategy_name);
