// Reductions (DESIGN.md §4) and autograd through tree ops, with issue 3's values, under every
// execution strategy; non-contiguous leaves; empty trees.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "tensor_test_util.hpp"
#include "treetensor/tensor/tensor.hpp"

#include <algorithm>
#include <string>

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

// All elements of all leaves as one flat tensor, in the leaves' promoted dtype (the default
// dtype for an empty tree): the reference for tree-level reductions (DESIGN.md §4).
at::Tensor all_elements(const TensorTree& t) {
  std::vector<at::Tensor> flat;
  for (const auto& x : leaves(t)) flat.push_back(x.reshape({-1}));
  return flat.empty() ? at::empty({0}) : at::cat(flat);
}

namespace rd = treetensor::rounding;
constexpr double kInf = std::numeric_limits<double>::infinity();

// Rounding bounds for two computations of one reduction over the same n elements in another
// order (rounding.hpp; Higham §3.1 and §4.2). `dtype` is the lowest precision of the leaves.
// A sum errs by at most gamma_n * sum|x| on either side.
double sum_bound(const at::Tensor& all, at::ScalarType dtype) {
  return 2 * rd::gamma(all.numel(), dtype) * all.abs().sum().item<double>();
}
// A mean is a sum, then one division.
double mean_bound(const at::Tensor& all, at::ScalarType dtype) {
  return 2 * rd::gamma(all.numel() + 1, dtype) * all.abs().mean().item<double>();
}
// A p-norm of positive terms: each |x|^p and each leaf norm raised again carries a few
// correctly-rounded-to-1-ulp roundings (2u each), the sums over n elements and L leaves
// gamma_n and gamma_L, and the final root scales relative error by 1/p: per side at most
// max(1, 1/p) * gamma_{2(n + L) + 16} relative.
double norm_bound(const at::Tensor& all, std::size_t leaves, double p, double value,
                  at::ScalarType dtype) {
  const auto terms = 2 * (all.numel() + static_cast<int64_t>(leaves)) + 16;
  return 2 * std::max(1.0, 1.0 / p) * rd::gamma(terms, dtype) * std::abs(value);
}
// Two-pass std: the mean errs by delta <= gamma_{n+1} sum|x|/n, which adds n·delta² to the
// sum of squares; the squares' sum, the division and the root add gamma_{n+4} relative. So
// per side |s_hat - s| <= gamma_{n+4} (s + sqrt(sum x² / (n - 1))) (Cauchy-Schwarz on delta).
double std_bound(const at::Tensor& all, double value, at::ScalarType dtype) {
  const auto n = all.numel();
  const double rms = std::sqrt(all.square().sum().item<double>() / double(n - 1));
  return 2 * rd::gamma(n + 4, dtype) * (std::abs(value) + rms);
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

// Every tree-level reduction against torch's reduction of the concatenated elements: exact
// for min/max/all/any and the counting and extreme norms (p = 0, inf, -inf), within the
// derived rounding bound for sums, means, finite p-norms and std (another summation order).
void expect_reductions_match_concatenation(const TreeTensor& t, const std::string& what) {
  SCOPED_TRACE(what);
  const at::Tensor all = all_elements(t);
  const at::ScalarType low = at::kFloat;  // the lowest leaf precision in these trees
  auto value = [](const at::Tensor& x) { return x.item<double>(); };
  EXPECT_EQ(tt::sum(t).scalar_type(), all.sum().scalar_type());
  EXPECT_LE(std::abs(value(tt::sum(t)) - value(all.sum())), sum_bound(all, low));
  for (double p : {0.0, 0.5, 1.0, 2.0, 3.0, kInf, -kInf}) {
    SCOPED_TRACE("p = " + std::to_string(p));
    if (all.numel() == 0 && std::isinf(p)) {
      // PyTorch 2.x: an infinite norm of no element has no identity, and is an error; as torch.
      EXPECT_THROW(all.norm(p), c10::Error);
      EXPECT_THROW(tt::norm(t, p), c10::Error);
      continue;
    }
    const at::Tensor got = tt::norm(t, p), want = all.norm(p);
    EXPECT_EQ(got.scalar_type(), want.scalar_type());
    if (p == 0 || std::isinf(p) || all.numel() == 0)
      EXPECT_TRUE(got.equal(want)) << got << " vs " << want;
    else
      EXPECT_LE(std::abs(value(got) - value(want)),
                norm_bound(all, t.leaf_count(), p, value(want), low));
  }
  EXPECT_TRUE(tt::all(t).equal(all.all()));
  EXPECT_TRUE(tt::any(t).equal(all.any()));
  if (all.numel() == 0) return;  // mean/std are NaN and min/max throw (EmptyTrees... below)
  EXPECT_LE(std::abs(value(tt::mean(t)) - value(all.mean())), mean_bound(all, low));
  EXPECT_TRUE(tt::min(t).equal(all.min()));
  EXPECT_TRUE(tt::max(t).equal(all.max()));
  if (all.numel() < 2) return;
  EXPECT_LE(std::abs(value(tt::std(t)) - value(all.std())), std_bound(all, value(all.std()), low));
  EXPECT_LE(std::abs(value(tt::std(t, false)) - value(all.std(false))),
            std_bound(all, value(all.std(false)), low));
}

TEST_P(TensorReduce, TreeLevelEqualsReductionOfAllElements) {
  TreeTensor t =
      randn_tree({{"a", {4, 5}}, {"b", {{"x", {7}}, {"y", tt::Shape{}}}}, {"e", {0, 3}}});
  t.insert("d", TensorTree(at::randn({3, 3}, at::kDouble)));
  expect_reductions_match_concatenation(t, "float and float64 leaves, a 0-d and a 0-element leaf");
  // Zeros count for p = 0 by element, not by leaf: 21 nonzero elements in 2 leaves.
  TreeTensor sparse{{"a", at::tensor({0.0f, 1.0f, 2.0f})},
                    {"b", at::cat({at::zeros({5}), at::arange(1, 20, at::kFloat)})}};
  EXPECT_EQ(tt::norm(sparse, 0).item<float>(), 21.0f);
  EXPECT_EQ(tt::norm(TreeTensor{{"a", at::tensor({0.0f, 1.0f, 2.0f})}}, 0).item<float>(), 2.0f);
  expect_reductions_match_concatenation(sparse, "zeros");
  // -inf: the smallest |x| over elements that exist; a 0-element leaf adds none.
  TreeTensor hollow{{"a", at::tensor({-3.0f, 2.0f})}, {"e", at::zeros({0})}};
  EXPECT_EQ(tt::norm(hollow, -kInf).item<float>(), 2.0f);
  expect_reductions_match_concatenation(hollow, "a 0-element leaf");
  expect_reductions_match_concatenation(TreeTensor{{"s", at::scalar_tensor(-2.5)}}, "one 0-d leaf");
  expect_reductions_match_concatenation(TreeTensor{{"a", at::zeros({0})}, {"b", at::zeros({2, 0})}},
                                        "no elements");
  expect_reductions_match_concatenation(TreeTensor(), "the empty tree");
  EXPECT_EQ(tt::sum(t).scalar_type(), at::kDouble) << "float + double leaves promote";
  EXPECT_TRUE(t.sum().equal(tt::sum(t)));
  EXPECT_EQ(tt::all(t > -100).item<bool>(), true);
  EXPECT_EQ(tt::any(t > 100).item<bool>(), false);
  TreeTensor ints = tt::randint(0, 5, {{"p", {3}}, {"q", {2, 2}}});
  EXPECT_EQ(tt::sum(ints).scalar_type(), at::kLong);
  EXPECT_EQ(tt::sum(ints).item<int64_t>(), all_elements(ints).sum().item<double>());
  EXPECT_THROW(tt::mean(ints), c10::Error);  // as at::mean of an integer tensor
}

TEST_P(TensorReduce, LowPrecisionLeavesReduceInThePromotedDtype) {
  // As torch's reduction of torch.cat of the leaves, which promotes before reducing: a float16
  // leaf of 70,000 ones beside a float32 one sums to 70,001, not to float16's inf (past 65504).
  TreeTensor t{{"a", at::ones({70000}, at::kHalf)}, {"b", at::ones({1})}};
  EXPECT_EQ(tt::sum(t).scalar_type(), at::kFloat);
  EXPECT_EQ(tt::sum(t).item<float>(), 70001.0f);
  TreeTensor halves{{"a", at::ones({70000}, at::kHalf)}, {"b", at::ones({3}, at::kBFloat16)}};
  EXPECT_EQ(tt::sum(halves).item<float>(), all_elements(halves).sum().item<float>());
  EXPECT_EQ(tt::sum(halves).item<float>(), 70003.0f);
  // A bool leaf beside a float one is taken as float, as in torch.cat (it raised: no bool `-`).
  TreeTensor mixed{{"a", at::tensor({1, 0}).to(at::kBool)}, {"b", at::tensor({0.5f})}};
  EXPECT_NEAR(tt::std(mixed).item<float>(), all_elements(mixed).std().item<float>(), 1e-6);
  EXPECT_NEAR(tt::std(mixed).item<float>(), 0.5f, 1e-6);
  // Squares of float16 deviations are taken in float32: 300^2 is past float16's range.
  TreeTensor wide{{"a", at::tensor({-300.0f, 300.0f}).to(at::kHalf)}, {"b", at::zeros({2})}};
  EXPECT_TRUE(std::isfinite(tt::std(wide).item<float>()));
  EXPECT_NEAR(tt::std(wide).item<float>(), all_elements(wide).std().item<float>(), 1e-3);
  // Leaves all float16 or all bfloat16: accumulated in float32 and rounded once, as at::sum,
  // at::mean and at::std of their concatenation (partials rounded per leaf lost 2049 + 1 and
  // overflowed past 65504).
  for (const at::ScalarType low : {at::kHalf, at::kBFloat16}) {
    TreeTensor ones{{"a", at::ones({2049}, low)}, {"b", at::ones({1}, low)}};
    const at::Tensor cat = all_elements(ones);
    EXPECT_EQ(tt::sum(ones).scalar_type(), low);
    EXPECT_TRUE(tt::sum(ones).equal(cat.sum())) << tt::sum(ones) << " vs " << cat.sum();
    TreeTensor many{{"a", at::ones({70000}, low)}, {"b", at::ones({3}, low)}};
    EXPECT_TRUE(tt::mean(many).equal(all_elements(many).mean())) << tt::mean(many);
    TreeTensor spread{{"a", at::tensor({-300.0f, 300.0f}).to(low)}, {"b", at::zeros({1}, low)}};
    EXPECT_EQ(tt::std(spread).scalar_type(), low);
    EXPECT_TRUE(tt::std(spread).equal(all_elements(spread).std())) << tt::std(spread);
  }
}

TEST_P(TensorReduce, NonContiguousLeaves) {
  TreeTensor base = randn_tree({{"a", {6, 4}}, {"b", {{"x", {5, 8}}}}});
  TreeTensor t = tt::transpose(base, 0, 1);
  t = tt::index(t, {at::indexing::Slice(), at::indexing::Slice(0, at::indexing::None, 2)});
  for (const auto& x : leaves(t)) ASSERT_FALSE(x.is_contiguous());
  expect_reductions_match_concatenation(t, "non-contiguous leaves");
  expect_same(tt::leaf_mean(t, {1}), native([](auto& x) { return x.mean({1}); }, t));
}

TEST_P(TensorReduce, EmptyTreesAndTreesWithoutElements) {
  const TreeTensor none;
  EXPECT_EQ(tt::sum(none).scalar_type(), at::get_default_dtype_as_scalartype());
  EXPECT_EQ(tt::sum(none).item<float>(), 0.0f);
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

  // Complex leaves: torch's std is real, from |x - mean|^2.
  const at::Tensor ca =
      at::complex(at::tensor({1.0f, 2.0f, 0.0f}), at::tensor({1.0f, -1.0f, 0.0f}));
  const at::Tensor cb = at::complex(at::tensor({0.5f, -1.0f}), at::tensor({0.0f, 2.0f}));
  TreeTensor complex{{"a", ca}, {"b", cb}};
  const at::Tensor flat = at::cat({ca, cb});
  EXPECT_EQ(tt::std(complex).scalar_type(), at::kFloat);
  EXPECT_NEAR(tt::std(complex).item<float>(), flat.std().item<float>(), 1e-6);

  // No degree of freedom: NaN in the dtype torch gives all the elements, not the default one.
  for (const bool unbiased : {true, false}) {
    TreeTensor few{{"a", at::zeros({0}, at::kDouble)},
                   {"b", at::ones({unbiased ? 1 : 0}, at::kHalf)}};
    const at::Tensor want =
        at::cat({at::zeros({0}, at::kDouble), at::ones({unbiased ? 1 : 0}, at::kHalf)})
            .std(unbiased);
    const at::Tensor got = tt::std(few, unbiased);
    EXPECT_EQ(got.scalar_type(), at::kDouble);
    EXPECT_EQ(got.scalar_type(), want.scalar_type());
    EXPECT_TRUE(std::isnan(got.item<double>()) && std::isnan(want.item<double>()));
  }
}

// reduction_dtype() is what a pending tree-level result is allocated with before the job runs
// (DESIGN.md §10): it must name the dtype each reduction returns, plain and consolidated.
TEST_P(TensorReduce, ReductionDtypeIsTheResultsDtype) {
  using R = tt::Reduction;
  const at::Tensor c = at::complex(at::tensor({1.0f, 2.0f}), at::tensor({0.5f, -1.0f}));
  const std::vector<TreeTensor> trees{
      TreeTensor{{"a", at::ones({3}, at::kHalf)}, {"b", at::ones({2})}},
      TreeTensor{{"a", at::tensor({1, 2})}, {"b", bools({1, 0})}},
      TreeTensor{{"a", at::tensor({1, 2})}, {"b", at::tensor({0.5}, at::kDouble)}},
      TreeTensor{{"a", c}, {"b", at::ones({2}, at::kDouble)}},
      TreeTensor{{"a", at::zeros({0}, at::kDouble)}, {"b", at::ones({2}, at::kHalf)}},
      TreeTensor{{"a", at::ones({2}, at::kBFloat16)}}};
  for (const TreeTensor& plain : trees)
    for (const TreeTensor& t : {plain, tt::consolidate(plain)}) {
      const std::string what = ::testing::PrintToString(t);
      EXPECT_EQ(tt::reduction_dtype(R::sum, t), tt::sum(t).scalar_type()) << what;
      EXPECT_EQ(tt::reduction_dtype(R::all, t), tt::all(t).scalar_type()) << what;
      EXPECT_EQ(tt::reduction_dtype(R::any, t), tt::any(t).scalar_type()) << what;
      if (!leaves(t)[0].is_complex()) {
        EXPECT_EQ(tt::reduction_dtype(R::min, t), tt::min(t).scalar_type()) << what;
        EXPECT_EQ(tt::reduction_dtype(R::max, t), tt::max(t).scalar_type()) << what;
      }
      const auto floating = tt::reduction_dtype(R::mean, t);
      if (at::isIntegralType(*floating, /*includeBool=*/true)) {
        EXPECT_THROW(tt::mean(t), c10::Error) << what;
        continue;
      }
      EXPECT_EQ(floating, tt::mean(t).scalar_type()) << what;
      EXPECT_EQ(tt::reduction_dtype(R::std, t), tt::std(t).scalar_type()) << what;
    }
  // A constant in the default dtype: no dtype to promote.
  for (const R r : {R::sum, R::mean, R::std, R::min, R::max})
    EXPECT_EQ(tt::reduction_dtype(r, TreeTensor{}), std::nullopt);
  EXPECT_EQ(tt::reduction_dtype(R::max, TreeTensor{{"a", at::zeros({0})}}), std::nullopt);
  EXPECT_EQ(tt::reduction_dtype(R::any, TreeTensor{}), at::kBool);
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
  // d(mean²)/dx = 2·5 / 7: the division rounds once, every other backward step copies.
  for (const auto& x : leaves(g)) EXPECT_TRUE(x.equal(at::full_like(x, 10.0f / 7.0f))) << x;
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
    // grad w = x^T @ g, g = 2 sigmoid'(x @ w). The forward matmul may round differently in a
    // lane (one BLAS thread): |dz| <= 2 gamma_K (|x| @ |w|); |sigmoid''| <= sqrt(3)/18, so
    // |dg| <= 2 (sqrt(3)/18) |dz| + 8u |g| (sigmoid and its derivative, a few roundings each);
    // then |d grad| <= |x|^T @ |dg| plus the backward matmul's own bound.
    const at::Tensor xd = xl.to(at::kDouble), g = wl.grad().to(at::kDouble);
    const at::Tensor dz = 2 * rd::gamma(xl.size(1), at::kFloat) *
                          at::matmul(xd.abs(), wl.detach().to(at::kDouble).abs());
    const at::Tensor z = at::matmul(xd, wl.detach().to(at::kDouble));
    const at::Tensor local = 2 * at::sigmoid(z) * (1 - at::sigmoid(z));
    const at::Tensor dg =
        2 * (std::sqrt(3.0) / 18) * dz + 8 * rd::unit_roundoff(at::kFloat) * local;
    const at::Tensor bound =
        at::matmul(xd.abs().t(), dg) + rd::matmul_bound(xl.t(), local.to(at::kFloat), at::kFloat);
    const auto agreement = rd::compare_within(w.grad().at(p).leaf(), wl.grad(), bound);
    EXPECT_TRUE(agreement.holds()) << p.str() << ": " << agreement.describe();
  }
  at::NoGradGuard no_grad;
  EXPECT_FALSE(tt::single((w * 2).requires_grad()));
}

INSTANTIATE_TEST_SUITE_P(Strategies, TensorReduce, ::testing::ValuesIn(strategies()),
                         strategy_name);
