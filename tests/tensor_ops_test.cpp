// Every op of the table and every hand-written op against the hand-written loop over at::
// calls, leaf by leaf, on the same random inputs — under every execution strategy.
// Inputs include mixed dtypes, 0-d leaves, empty leaves and the 320-leaf ResNet-50 tree.
#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <string>
#include <vector>

#include "op_cases.hpp"
#include "tensor_test_util.hpp"
#include "treetensor/tensor/tensor.hpp"

namespace tt = treetensor;
using namespace tt_test;
using tt::TreeTensor;

namespace {

class TensorOps : public ::testing::TestWithParam<rt::StreamMode> {
 protected:
  static void SetUpTestSuite() { at::manual_seed(0); }  // touch the generator before lanes
  void SetUp() override { at::manual_seed(42); }
  rt::StreamGuard guard_{GetParam()};
};

// Float leaves of several shapes (0-d and empty included) plus one float64 leaf.
TreeTensor mixed_float_tree() {
  TreeTensor t =
      randn_tree({{"a", {3, 4}}, {"b", {{"x", {5}}, {"y", tt::Shape{}}}}, {"e", {0, 2}}});
  t.insert("d", TensorTree(at::randn({2, 2}, at::kDouble)));
  return t;
}
TreeTensor same_structure_float(const TensorTree& like) {
  return tt::tree::map([](const at::Tensor& x) { return at::randn_like(x); }, like);
}
TreeTensor int_tree() {
  return tt::tree::map([](const at::Tensor& x) { return at::randint(1, 50, x.sizes(), at::kLong); },
                       mixed_float_tree());
}

bool integer_only(const std::string& name) {
  return name.rfind("bitwise_", 0) == 0;
}

}  // namespace

TEST_P(TensorOps, UnaryTableMatchesNativeLoop) {
  const TreeTensor f = mixed_float_tree();
  const TreeTensor i = int_tree();
  for (const auto& c : unary_cases) {
    SCOPED_TRACE(c.name);
    const TreeTensor& in = integer_only(c.name) ? i : f;
    expect_same(c.tree(in), native(c.native, in));
    TreeTensor target = in.clone();
    const auto impls = leaves(target);
    TreeTensor want = in.clone();
    for (const auto& x : leaves(want)) c.native_(x);
    EXPECT_EQ(&c.tree_(target), &target);
    expect_same(target, want);
    const auto after = leaves(target);
    for (std::size_t k = 0; k < after.size(); ++k) EXPECT_TRUE(after[k].is_same(impls[k]));
  }
  for (const auto& c : plain_unary_cases) {
    SCOPED_TRACE(c.name);
    expect_same(c.tree(f), native(c.native, f));
  }
}

TEST_P(TensorOps, BinaryTableMatchesNativeLoop) {
  const TreeTensor fa = mixed_float_tree(), fb = same_structure_float(fa);
  const TreeTensor fpos = tt::abs(fa) + 0.5;  // positive bases for pow
  const TreeTensor ia = int_tree(), ib = int_tree();
  for (const auto& c : binary_cases) {
    SCOPED_TRACE(c.name);
    const std::string name = c.name;
    const bool ints = integer_only(name);
    const TreeTensor& a = ints ? ia : (name == "pow" ? fpos : fa);
    const TreeTensor& b = ints ? ib : fb;
    const at::Scalar s = ints ? at::Scalar(int64_t{6}) : at::Scalar(1.75);
    expect_same(c.tree(a, b), native(c.tt_, a, b));
    expect_same(c.tree(a, s), native([&](const at::Tensor& x) { return c.ts_(x, s); }, a));
    const at::Tensor bt = ints ? at::tensor(int64_t{3}) : at::tensor(0.25);
    expect_same(c.tree(a, bt), native([&](const at::Tensor& x) { return c.tt_(x, bt); }, a));
    // In place, tree and scalar operands: comparisons write 0/1 in the leaf's own dtype.
    TreeTensor t1 = a.clone(), w1 = a.clone();
    const auto impls = leaves(t1);
    c.tree_(t1, b);
    const auto wl = leaves(w1), bl = leaves(b);
    for (std::size_t k = 0; k < wl.size(); ++k) c.inplace_tt(wl[k], bl[k]);
    expect_same(t1, w1);
    for (std::size_t k = 0; k < impls.size(); ++k) EXPECT_TRUE(leaves(t1)[k].is_same(impls[k]));
    TreeTensor t2 = a.clone(), w2 = a.clone();
    c.tree_(t2, s);
    for (const auto& x : leaves(w2)) c.inplace_ts(x, s);
    expect_same(t2, w2);
  }
  for (const auto& c : tensor_binary_cases) {
    SCOPED_TRACE(c.name);
    expect_same(c.tree(fa, fb), native(c.native, fa, fb));
    const at::Tensor half = at::native::wrapped_scalar_tensor(0.5);
    expect_same(c.tree(fa, 0.5),
                native([&](const at::Tensor& x) { return c.native(x, half); }, fa));
  }
}

// The registry's ops with a scalar argument (addcmul's value, lerp's weight): tree operands, a
// number operand (a wrapped-number tensor, as torch's), and in place on the same leaf tensors
// (stream(fused): at::_foreach_f_).
TEST_P(TensorOps, ScalarArgumentTablesMatchNativeLoop) {
  const TreeTensor a = mixed_float_tree(), b = same_structure_float(a);
  const TreeTensor c = tt::abs(same_structure_float(a)) + 0.5;  // divisors away from 0
  const at::Tensor two = at::native::wrapped_scalar_tensor(2.0);
  const auto al = leaves(a), bl = leaves(b), cl = leaves(c);
  const auto spec = tt::tree::flatten(a).spec;
  const auto expect_in_place = [&](const TreeTensor& got, const TreeTensor& want,
                                   const std::vector<at::Tensor>& impls) {
    expect_same(got, want);
    const auto after = leaves(got);
    for (std::size_t k = 0; k < after.size(); ++k) EXPECT_TRUE(after[k].is_same(impls[k]));
  };
  for (const auto& op : ternary_value_cases) {
    SCOPED_TRACE(op.name);
    std::vector<at::Tensor> want(al.size()), with_number(al.size());
    for (std::size_t k = 0; k < al.size(); ++k) {
      want[k] = op.native(al[k], bl[k], cl[k], -0.3);
      with_number[k] = op.native(al[k], bl[k], two, -0.3);
    }
    expect_same(op.tree(a, b, c, -0.3), TreeTensor(tt::tree::unflatten(spec, want)));
    expect_same(op.tree(a, b, 2.0, -0.3), TreeTensor(tt::tree::unflatten(spec, with_number)));
    for (std::size_t k = 0; k < al.size(); ++k) want[k] = op.native(al[k], bl[k], cl[k], 1);
    expect_same(op.tree(a, b, c, 1), TreeTensor(tt::tree::unflatten(spec, want)));
    TreeTensor target = a.clone(), reference = a.clone();
    const auto impls = leaves(target);
    EXPECT_EQ(&op.tree_(target, b, c, 0.7), &target);
    for (std::size_t k = 0; k < impls.size(); ++k)
      op.native_(leaves(reference)[k], bl[k], cl[k], 0.7);
    expect_in_place(target, reference, impls);
  }
  for (const auto& op : binary_weight_cases) {
    SCOPED_TRACE(op.name);
    std::vector<at::Tensor> want(al.size());
    for (std::size_t k = 0; k < al.size(); ++k) want[k] = op.native(al[k], bl[k], 0.25);
    expect_same(op.tree(a, b, 0.25), TreeTensor(tt::tree::unflatten(spec, want)));
    EXPECT_THROW(op.tree(a, 2.0, 0.25), c10::Error);  // end a number: refused, as at::lerp does
    TreeTensor target = a.clone(), reference = a.clone();
    const auto impls = leaves(target);
    EXPECT_EQ(&op.tree_(target, b, 0.75), &target);
    for (std::size_t k = 0; k < impls.size(); ++k) op.native_(leaves(reference)[k], bl[k], 0.75);
    expect_in_place(target, reference, impls);
  }
}

// The registry's defaults reach the free functions and methods (value = 1, as at::addcmul).
TEST_P(TensorOps, ScalarArgumentDefaults) {
  const TreeTensor a = mixed_float_tree(), b = same_structure_float(a);
  const TreeTensor c = tt::abs(same_structure_float(a)) + 0.5;
  expect_same(tt::addcmul(a, b, c), tt::addcmul(a, b, c, 1));
  expect_same(a.addcdiv(b, c), tt::addcdiv(a, b, c, 1));
  TreeTensor t = a.clone();
  t.addcmul_(b, c);
  expect_same(t, tt::addcmul(a, b, c, 1));
}

TEST_P(TensorOps, ArithmeticWithAlphaAndOptimizerMath) {
  const TreeTensor a = mixed_float_tree(), b = same_structure_float(a), c = same_structure_float(a);
  expect_same(tt::add(a, b, 0.5),
              native([](auto& x, auto& y) { return at::add(x, y, 0.5); }, a, b));
  expect_same(tt::sub(a, b, 2), native([](auto& x, auto& y) { return at::sub(x, y, 2); }, a, b));
  expect_same(tt::add(a, 3, 2), native([](auto& x) { return at::add(x, 3, 2); }, a));
  expect_same(a.add(b), native([](auto& x, auto& y) { return x.add(y); }, a, b));
  auto run_inplace = [&](auto tree_op, auto leaf_op) {
    TreeTensor got = a.clone(), want = a.clone();
    tree_op(got);
    const auto wl = leaves(want), bl = leaves(b), cl = leaves(c);
    for (std::size_t k = 0; k < wl.size(); ++k) leaf_op(wl[k], bl[k], cl[k]);
    expect_same(got, want);
  };
  run_inplace([&](TreeTensor& t) { tt::add_(t, b, 0.3); },
              [](auto& x, auto& y, auto&) { x.add_(y, 0.3); });
  run_inplace([&](TreeTensor& t) { tt::add_(t, 0.3); }, [](auto& x, auto&, auto&) { x.add_(0.3); });
  run_inplace([&](TreeTensor& t) { tt::sub_(t, b); }, [](auto& x, auto& y, auto&) { x.sub_(y); });
  run_inplace([&](TreeTensor& t) { tt::mul_(t, 0.9); }, [](auto& x, auto&, auto&) { x.mul_(0.9); });
  run_inplace([&](TreeTensor& t) { tt::div_(t, b); }, [](auto& x, auto& y, auto&) { x.div_(y); });
  run_inplace([&](TreeTensor& t) { tt::copy_(t, c); }, [](auto& x, auto&, auto& z) { x.copy_(z); });
  run_inplace([&](TreeTensor& t) { tt::zero_(t); }, [](auto& x, auto&, auto&) { x.zero_(); });
  run_inplace([&](TreeTensor& t) { tt::fill_(t, 2.5); },
              [](auto& x, auto&, auto&) { x.fill_(2.5); });
  run_inplace([&](TreeTensor& t) { tt::clamp_(t, -0.5, 0.5); },
              [](auto& x, auto&, auto&) { x.clamp_(-0.5, 0.5); });
  run_inplace([&](TreeTensor& t) { t.sqrt_(); }, [](auto& x, auto&, auto&) { x.sqrt_(); });
  expect_same(tt::clamp(a, c10::nullopt, 0.1),
              native([](auto& x) { return at::clamp(x, c10::nullopt, 0.1); }, a));
}

TEST_P(TensorOps, ComparisonFunctions) {
  const TreeTensor a = mixed_float_tree(), b = same_structure_float(a);
  const TreeTensor near = a + 1e-7;
  expect_same(tt::isclose(a, near),
              native([](auto& x, auto& y) { return at::isclose(x, y); }, a, near));
  EXPECT_TRUE(tt::allclose(a, near));
  EXPECT_FALSE(tt::allclose(a, b));
  EXPECT_TRUE(tt::equal(a, a.clone()));
  EXPECT_FALSE(tt::equal(a, b));
  TreeTensor other{{"a", at::ones(1)}};
  EXPECT_FALSE(tt::equal(a, other)) << "different structures are not equal";
  const TreeTensor inf = a / 0.0;
  expect_same(tt::isinf(inf), native([](auto& x) { return at::isinf(x); }, inf));
  expect_same(tt::isnan(inf), native([](auto& x) { return at::isnan(x); }, inf));
  expect_same(tt::isfinite(inf), native([](auto& x) { return at::isfinite(x); }, inf));
}

TEST_P(TensorOps, MatrixOpsAndTheirBatchedForm) {
  // Same shapes everywhere: the fused (bmm) form applies; to the matmul rounding bound.
  tt::ShapeTree sa, sb;
  for (int i = 0; i < 12; ++i) {
    sa.insert("m" + std::to_string(i), tt::Shape{4, 6});
    sb.insert("m" + std::to_string(i), tt::Shape{6, 3});
  }
  const TreeTensor a = randn_tree(sa), b = randn_tree(sb);
  expect_matmul_agrees(tt::matmul(a, b),
                       native([](auto& x, auto& y) { return at::matmul(x, y); }, a, b), a, b);
  expect_matmul_agrees(tt::mm(a, b), native([](auto& x, auto& y) { return at::mm(x, y); }, a, b), a,
                       b);
  expect_matmul_agrees(a.matmul(b), native([](auto& x, auto& y) { return at::matmul(x, y); }, a, b),
                       a, b);
  // Different shapes: per leaf.
  TreeTensor c = randn_tree({{"p", {2, 3}}, {"q", {{"r", {5, 1}}}}});
  TreeTensor d = randn_tree({{"p", {3, 4}}, {"q", {{"r", {1, 2}}}}});
  expect_matmul_agrees(tt::matmul(c, d),
                       native([](auto& x, auto& y) { return at::matmul(x, y); }, c, d), c, d);
  at::Tensor w = at::randn({3, 3});
  TreeTensor e = randn_tree({{"p", {2, 3}}, {"q", {4, 3}}});
  expect_matmul_agrees(tt::matmul(e, w), native([&](auto& x) { return at::matmul(x, w); }, e), e,
                       [&](std::size_t) { return w; });
  TreeTensor v = randn_tree({{"p", {7}}, {"q", {3}}}), u = randn_tree({{"p", {7}}, {"q", {3}}});
  expect_matmul_agrees(tt::dot(v, u), native([](auto& x, auto& y) { return at::dot(x, y); }, v, u),
                       v, u);
}

TEST_P(TensorOps, ShapeOps) {
  const TreeTensor a = randn_tree({{"a", {2, 6}}, {"b", {{"x", {4, 6}}}}});
  const TreeTensor b = same_structure_float(a);
  expect_same(tt::reshape(a, {-1}), native([](auto& x) { return x.reshape({-1}); }, a));
  expect_same(a.view({3, -1}), native([](auto& x) { return x.view({3, -1}); }, a));
  expect_same(tt::unsqueeze(a, 0), native([](auto& x) { return x.unsqueeze(0); }, a));
  expect_same(tt::squeeze(tt::unsqueeze(a, 1), 1), a);
  expect_same(tt::squeeze(tt::unsqueeze(a, 0)), a);
  expect_same(a.transpose(0, 1), native([](auto& x) { return x.transpose(0, 1); }, a));
  expect_same(a.permute({1, 0}), native([](auto& x) { return x.permute({1, 0}); }, a));
  expect_same(tt::flatten(a), native([](auto& x) { return x.flatten(); }, a));
  expect_same(tt::cat({a, b}, 1), native(
                                      [](auto& x, auto& y) {
                                        return at::cat({x, y}, 1);
                                      },
                                      a, b));
  expect_same(tt::stack({a, b, a}), native(
                                        [](auto& x, auto& y) {
                                          return at::stack({x, y, x});
                                        },
                                        a, b));
  expect_same(tt::where(a > 0, a, b),
              native([](auto& x, auto& y) { return at::where(x > 0, x, y); }, a, b));
  expect_same(
      tt::where(a > 0, a, 0.0),
      native([](auto& x) { return at::where(x > 0, x, at::native::wrapped_scalar_tensor(0.0)); },
             a));
  const auto parts = tt::split(a, 2, 1);
  ASSERT_EQ(parts.size(), 3u);
  for (int k = 0; k < 3; ++k)
    expect_same(parts[k], native([&](auto& x) { return x.split(2, 1)[k]; }, a));
  const auto chunks = a.chunk(2, 1);
  ASSERT_EQ(chunks.size(), 2u);
  expect_same(chunks[1], native([](auto& x) { return x.chunk(2, 1)[1]; }, a));
  const auto rows = tt::unbind(tt::index(a, {at::indexing::Slice(0, 2)}));
  ASSERT_EQ(rows.size(), 2u);
  expect_same(rows[0], native([](auto& x) { return x[0]; }, a));
  try {
    (void)tt::split(a, 2, 0);  // a: 1 piece along dim 0, b.x: 2 pieces
    FAIL();
  } catch (const tt::tree::StructureError& e) {
    EXPECT_NE(std::string(e.what()).find("leaf 'b.x' gave 2 results but leaf 'a' gave 1"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW((void)tt::cat({}), std::invalid_argument);
}

TEST_P(TensorOps, ResNet50StateDictTree) {
  std::ifstream in(TREETENSOR_SOURCE_DIR "/data/models/resnet50.json");
  ASSERT_TRUE(in) << "data/models/resnet50.json";
  const auto doc = nlohmann::json::parse(in);
  std::vector<std::pair<std::string, at::Tensor>> items;
  for (const auto& e : doc.at("tensors")) {
    const auto shape = e.at("shape").get<std::vector<int64_t>>();
    const bool is_int = e.at("dtype").get<std::string>() == "int64";
    at::Tensor full = is_int ? at::randint(0, 9, shape, at::kLong) : at::randn(shape);
    items.emplace_back(e.at("key").get<std::string>(), full);
  }
  const TreeTensor params = tt::from_state_dict(items);
  ASSERT_EQ(params.leaf_count(), 320u);
  const TreeTensor other =
      tt::tree::map([](const at::Tensor& x) { return at::ones_like(x); }, params);
  expect_same(params + other, native([](auto& x, auto& y) { return x + y; }, params, other));
  expect_same(params * 0.5, native([](auto& x) { return x * 0.5; }, params));
  // The tree sum adds the leaf sums (each bitwise the loop's) in float32 after promotion
  // checks; the loop adds them in float64. Summing L terms in float32 errs by at most
  // gamma_L(float32) * sum |s_l| (rounding.hpp), the float64 side by far less.
  double want = 0, magnitude = 0;
  for (const auto& [k, v] : items) {
    want += v.sum().item<double>();
    magnitude += std::abs(v.sum().item<double>());
  }
  const double bound = 2 * treetensor::rounding::gamma(params.leaf_count(), at::kFloat) * magnitude;
  EXPECT_LE(std::abs(tt::sum(params).item<double>() - want), bound);
}

INSTANTIATE_TEST_SUITE_P(Strategies, TensorOps, ::testing::ValuesIn(strategies()), strategy_name);

// Uniform trees (one dtype, equal shapes per leaf pair): under stream(fused) the batched
// forms (at::_foreach_*, bmm) run; values must equal the per-leaf loop bitwise (bmm: to the
// matmul rounding bound).
class TensorFused : public TensorOps {};

TEST_P(TensorFused, BatchedFormsGiveNativeValues) {
  const TreeTensor a = randn_tree({{"a", {3, 4}}, {"b", {{"x", {5}}, {"y", {2, 2}}}}});
  const TreeTensor b = same_structure_float(a), c = tt::abs(same_structure_float(a)) + 0.1;
  for (const auto& u : unary_cases) {
    SCOPED_TRACE(u.name);
    if (integer_only(u.name)) continue;
    expect_same(u.tree(a), native(u.native, a));
    TreeTensor got = a.clone(), want = a.clone();
    u.tree_(got);
    for (const auto& x : leaves(want)) u.native_(x);
    expect_same(got, want);
  }
  expect_same(a + b, native([](auto& x, auto& y) { return x + y; }, a, b));
  expect_same(a - b, native([](auto& x, auto& y) { return x - y; }, a, b));
  expect_same(a * b, native([](auto& x, auto& y) { return x * y; }, a, b));
  expect_same(a / c, native([](auto& x, auto& y) { return x / y; }, a, c));
  expect_same(a * 3.5, native([](auto& x) { return x * 3.5; }, a));
  expect_same(tt::add(a, b, 0.5),
              native([](auto& x, auto& y) { return at::add(x, y, 0.5); }, a, b));
  TreeTensor got = a.clone(), want = a.clone();
  tt::mul_(got, 0.9);
  tt::add_(got, b, 0.1);
  tt::addcmul_(got, b, b, 0.01);
  tt::addcdiv_(got, b, c, -0.5);
  tt::div_(got, c);
  tt::sub_(got, 1.0);
  const auto bl = leaves(b), cl = leaves(c);
  const auto wl = leaves(want);
  for (std::size_t k = 0; k < wl.size(); ++k) {
    wl[k].mul_(0.9).add_(bl[k], 0.1).addcmul_(bl[k], bl[k], 0.01).addcdiv_(bl[k], cl[k], -0.5);
    wl[k].div_(cl[k]).sub_(1.0);
  }
  expect_same(got, want);
  tt::zero_(got);
  EXPECT_TRUE(tt::equal(got, tt::zeros_like(a)));
}

TEST_P(TensorFused, MatmulOfEqualShapesIsOneBatchedProductUnderFusedMode) {
  tt::ShapeTree sa, sb;
  for (int i = 0; i < 5; ++i) sa.insert("m" + std::to_string(i), tt::Shape{3, 4});
  for (int i = 0; i < 5; ++i) sb.insert("m" + std::to_string(i), tt::Shape{4, 2});
  const TreeTensor a = randn_tree(sa), b = randn_tree(sb);
  const TreeTensor r = tt::matmul(a, b);
  expect_matmul_agrees(r, native([](auto& x, auto& y) { return at::matmul(x, y); }, a, b), a, b);
  const auto l = leaves(r);
  const bool one_storage = l[0].storage().is_alias_of(l[4].storage());
  // stream(fused) must take the batched form; linear and lanes never do (automatic may).
  if (GetParam() == rt::StreamMode::of(rt::fused)) {
    EXPECT_TRUE(one_storage);
  }
  if (GetParam().kind == rt::StreamMode::Kind::lanes) {
    EXPECT_FALSE(one_storage);
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, TensorFused, ::testing::ValuesIn(strategies()), strategy_name);
