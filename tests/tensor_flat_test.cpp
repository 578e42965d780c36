// Flat execution on consolidated trees (DESIGN.md §12): every flat-capable op, under every
// strategy, bitwise equal to the hand-written per-leaf loop; results are consolidated and
// deferred (no leaf tensor made until first access); autograd and 0-d cases fall back.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "op_cases.hpp"
#include "tensor_test_util.hpp"
#include "treetensor/tensor/tensor.hpp"

namespace tt = treetensor;
using namespace tt_test;

namespace {

class Flat : public ::testing::TestWithParam<rt::StreamMode> {
 protected:
  static void SetUpTestSuite() { at::manual_seed(0); }
  void SetUp() override { at::manual_seed(7); }
  rt::StreamGuard guard_{GetParam()};
};

// Two dtype groups; sizes 0, 1, 7 and 1025 (the vector tail) and a 2-D leaf; no 0-d leaf.
TreeTensor plain_tree() {
  return TreeTensor{{"a", at::randn({1025})},
                    {"b", TensorTree{{"x", at::randn({7})}, {"y", at::randn({0})}}},
                    {"c", at::randn({1})},
                    {"d", at::randn({3, 4}, at::kDouble)},
                    {"e", at::randn({5}, at::kDouble)}};
}
TreeTensor like(const TensorTree& t) {
  return tt::tree::map([](const at::Tensor& x) { return at::randn_like(x); }, t);
}

// A flat result: consolidated, with the operands' layout, no leaf made yet.
void expect_flat_result(const TreeTensor& r) {
  EXPECT_TRUE(tt::is_consolidated(r));
  EXPECT_TRUE(r.is_deferred());
}

bool integer_only(const std::string& n) {
  return n.rfind("bitwise_", 0) == 0;
}

// Ops computed by a libm-style function rather than correctly rounded arithmetic (the
// registry's libm column, tt_test::libm_function). ATen runs the last (n mod 16) elements of a
// tensor through the scalar form (glibc) and the rest through the vector form (Sleef): a leaf's
// tail lies inside the buffer's vector body, so these may differ from the per-leaf loop there
// (on this CPU: sigmoid, sinh, cosh, atan2). Every other op is correctly rounded in both forms,
// hence bitwise equal.
// Those agree within expect_within_ulps' bound (tensor_test_util.hpp), the others bitwise.
void expect_agrees(const std::string& op, const TensorTree& got, const TensorTree& want) {
  if (libm_function(op))
    expect_within_ulps(got, want);
  else
    expect_same(got, want);
}

using CT = const at::Tensor&;

// The per-leaf loop over `t` in place: a clone whose leaves got f (with b's leaf).
template <class F>
TreeTensor native_inplace(const TensorTree& t, F&& f) {
  TreeTensor out = tt::tree::map([](CT x) { return x.clone(); }, t);
  for (const auto& x : leaves(out)) f(x);
  return out;
}
template <class F>
TreeTensor native_inplace2(const TensorTree& t, const TensorTree& b, F&& f) {
  TreeTensor out = tt::tree::map([](CT x) { return x.clone(); }, t);
  const auto ol = leaves(out), bl = leaves(b);
  for (std::size_t i = 0; i < ol.size(); ++i) f(ol[i], bl[i]);
  return out;
}
template <class F>
TreeTensor native3(F&& f, const TensorTree& a, const TensorTree& b, const TensorTree& c) {
  return tt::tree::zip_map(f, a, b, c);
}

}  // namespace

TEST_P(Flat, UnaryTableIsBitwiseThePerLeafLoop) {
  const TreeTensor p = plain_tree();
  const TreeTensor c = tt::consolidate(p);
  for (const auto& u : unary_cases) {
    const std::string name = u.name;
    if (integer_only(name)) continue;  // integer buffers stay per leaf
    SCOPED_TRACE(name);
    const TreeTensor r = u.tree(c);
    if (name != "detach") expect_flat_result(r);
    expect_agrees(name, r, native(u.native, p));
    TreeTensor target = tt::consolidate(p);
    const at::Tensor buffer = tt::consolidated_groups(target)[0].buffer;
    u.tree_(target);
    EXPECT_TRUE(tt::is_consolidated(target));
    expect_agrees(name, target, native_inplace(p, u.native_));
    EXPECT_TRUE(tt::consolidated_groups(target)[0].buffer.is_same(buffer)) << "updated in place";
  }
  for (auto f : {&tt::isfinite, &tt::isnan, &tt::isinf, &tt::signbit, &tt::clone}) {
    const TreeTensor r = f(c);
    expect_flat_result(r);
  }
  expect_same(tt::isnan(c), native([](const at::Tensor& x) { return at::isnan(x); }, p));
  expect_same(tt::clone(c), p);
}

TEST_P(Flat, BinaryTableWithTreesScalarsAndZeroDimTensors) {
  const TreeTensor pa = plain_tree(), pb = like(pa);
  const TreeTensor pos = native([](const at::Tensor& x) { return x.abs() + 0.5; }, pa);
  const TreeTensor ca = tt::consolidate(pa), cb = tt::consolidate(pb), cpos = tt::consolidate(pos);
  const at::Tensor zero_d = at::scalar_tensor(1.25, at::kDouble);
  for (const auto& b : binary_cases) {
    const std::string name = b.name;
    if (integer_only(name)) continue;
    SCOPED_TRACE(name);
    const TreeTensor& a = name == "pow" ? pos : pa;
    const TreeTensor& ac = name == "pow" ? cpos : ca;
    TreeTensor r = b.tree(ac, cb);
    expect_flat_result(r);
    expect_agrees(name, r, native(b.tt_, a, pb));
    r = b.tree(ac, 1.75);
    expect_flat_result(r);
    expect_agrees(name, r, native([&](const at::Tensor& x) { return b.ts_(x, 1.75); }, a));
    r = b.tree(ac, zero_d);
    expect_flat_result(r);
    expect_agrees(name, r, native([&](const at::Tensor& x) { return b.tt_(x, zero_d); }, a));
    r = b.tree(2.5, ac);  // a scalar first operand: a wrapped number
    expect_agrees(name, r,
                  native([&](const at::Tensor& x) { return b.tt_(at::scalar_tensor(2.5), x); }, a));
    // In place with a tree operand; comparisons write 0/1 in the target's dtype.
    TreeTensor target = tt::consolidate(a);
    b.tree_(target, cb);
    EXPECT_TRUE(tt::is_consolidated(target));
    expect_agrees(name, target, native_inplace2(a, pb, b.inplace_tt));
  }
}

TEST_P(Flat, TheOtherElementwiseOps) {
  const TreeTensor pa = plain_tree(), pb = like(pa), pc = like(pa);
  const TreeTensor a = tt::consolidate(pa), b = tt::consolidate(pb), c = tt::consolidate(pc);
  auto check = [](const TreeTensor& got, const TreeTensor& want) {
    expect_flat_result(got);
    expect_same(got, want);
  };
  check(tt::add(a, b, 0.5), native([](CT x, CT y) { return at::add(x, y, 0.5); }, pa, pb));
  check(tt::sub(a, 3.0, 2), native([](CT x) { return at::sub(x, 3.0, 2); }, pa));
  check(a + b, native([](CT x, CT y) { return x + y; }, pa, pb));
  check(-a, native([](CT x) { return -x; }, pa));
  for (const auto& [name, f] : std::vector<std::pair<std::string, at::Tensor (*)(CT, CT)>>{
           {"atan2", &at::atan2}, {"maximum", &at::maximum}, {"minimum", &at::minimum}}) {
    SCOPED_TRACE(name);
    const TreeTensor r = name == "atan2"     ? tt::atan2(a, b)
                         : name == "maximum" ? tt::maximum(a, b)
                                             : tt::minimum(a, b);
    expect_flat_result(r);
    expect_agrees(name, r, native(f, pa, pb));
  }
  check(tt::logical_and(tt::gt(a, 0), tt::lt(b, 0)),
        native([](CT x, CT y) { return at::logical_and(x > 0, y < 0); }, pa, pb));
  check(tt::clamp(a, -0.5, 0.5), native([](CT x) { return at::clamp(x, -0.5, 0.5); }, pa));
  check(tt::addcmul(a, b, c, 0.5),
        native3([](CT x, CT y, CT z) { return at::addcmul(x, y, z, 0.5); }, pa, pb, pc));
  check(tt::addcdiv(a, b, c, 2),
        native3([](CT x, CT y, CT z) { return at::addcdiv(x, y, z, 2); }, pa, pb, pc));
  check(tt::lerp(a, b, 0.25), native([](CT x, CT y) { return at::lerp(x, y, 0.25); }, pa, pb));
  check(tt::where(tt::gt(a, 0), a, b),
        native([](CT x, CT y) { return at::where(x > 0, x, y); }, pa, pb));
  check(tt::isclose(a, b, 0.5, 0.5),
        native([](CT x, CT y) { return at::isclose(x, y, 0.5, 0.5); }, pa, pb));

  auto in_place = [&](const char* name, auto&& tree_op, auto&& leaf_op) {
    SCOPED_TRACE(name);
    TreeTensor t = tt::consolidate(pa);
    tree_op(t);
    EXPECT_TRUE(tt::is_consolidated(t));
    TreeTensor want = tt::tree::map([](CT x) { return x.clone(); }, pa);
    const auto wl = leaves(want), bl = leaves(pb), cl = leaves(pc);
    for (std::size_t i = 0; i < wl.size(); ++i) leaf_op(wl[i], bl[i], cl[i]);
    expect_same(t, want);
  };
  in_place(
      "add_", [&](TreeTensor& t) { t.add_(b, 3); }, [](CT x, CT y, CT) { x.add_(y, 3); });
  in_place(
      "clamp_", [&](TreeTensor& t) { t.clamp_(-0.1, 0.2); },
      [](CT x, CT, CT) { x.clamp_(-0.1, 0.2); });
  in_place(
      "addcmul_", [&](TreeTensor& t) { t.addcmul_(b, c, 0.5); },
      [](CT x, CT y, CT z) { x.addcmul_(y, z, 0.5); });
  in_place(
      "addcdiv_", [&](TreeTensor& t) { t.addcdiv_(b, c, 0.5); },
      [](CT x, CT y, CT z) { x.addcdiv_(y, z, 0.5); });
  in_place(
      "lerp_", [&](TreeTensor& t) { t.lerp_(b, 0.75); }, [](CT x, CT y, CT) { x.lerp_(y, 0.75); });
  in_place(
      "copy_", [&](TreeTensor& t) { t.copy_(b); }, [](CT x, CT y, CT) { x.copy_(y); });
  in_place(
      "zero_", [&](TreeTensor& t) { t.zero_(); }, [](CT x, CT, CT) { x.zero_(); });
  in_place(
      "fill_", [&](TreeTensor& t) { t.fill_(2.5); }, [](CT x, CT, CT) { x.fill_(2.5); });
}

// (x * 2 + y).sigmoid_(): the main job's chain, consolidated all the way.
TEST_P(Flat, ChainStaysConsolidatedAndNeverMakesLeaves) {
  const TreeTensor px = plain_tree(), py = like(px);
  const TreeTensor x = tt::consolidate(px), y = tt::consolidate(py);
  TreeTensor r = x * 2 + y;
  r.sigmoid_();
  EXPECT_TRUE(r.is_deferred()) << "in place on a deferred tree touched no leaf";
  EXPECT_TRUE(tt::is_consolidated(r));
  expect_same(r, native([](CT a, CT b) { return (a * 2 + b).sigmoid_(); }, px, py));
  // A copy made before any access makes its own views of the same buffers.
  const TreeTensor s = x + y;
  const TreeTensor s2 = s;
  EXPECT_TRUE(std::as_const(s).at("a").leaf().storage().is_alias_of(
      std::as_const(s2).at("a").leaf().storage()));
}

TEST_P(Flat, TreeReductionsOverBuffers) {
  const TreeTensor p = plain_tree();
  const TreeTensor c = tt::consolidate(p);
  const TreeTensor r = tt::sigmoid(c) - 0.5;  // padding holds sigmoid(0) - 0.5 = 0: harmless
  const TreeTensor s = c * 3 + 1;             // padding holds 1: must not count
  const TreeTensor ps = native([](CT x) { return x * 3 + 1; }, p);
  // Sums over a different split agree to the summation bound 2·γ_n·Σ|x| (n = all elements).
  double n = 0;
  for (const auto& x : leaves(p)) n += static_cast<double>(x.numel());
  const double u = std::ldexp(1.0, -24), gamma = n * u / (1 - n * u);
  const double bound = 2 * gamma * tt::sum(tt::abs(ps)).item<double>() + 1e-30;
  EXPECT_LE(std::abs(tt::sum(s).item<double>() - tt::sum(ps).item<double>()), bound);
  EXPECT_LE(std::abs(tt::mean(s).item<double>() - tt::mean(ps).item<double>()), bound);
  EXPECT_TRUE(tt::min(s).equal(tt::min(ps)));
  EXPECT_TRUE(tt::max(s).equal(tt::max(ps)));
  EXPECT_TRUE(tt::all(tt::gt(s, -100)).item<bool>());
  EXPECT_FALSE(tt::all(tt::gt(s, 1)).item<bool>());
  EXPECT_FALSE(tt::any(tt::gt(s, 1000)).item<bool>());
  EXPECT_TRUE(tt::norm(s, INFINITY).equal(tt::norm(ps, INFINITY)));
  EXPECT_TRUE(tt::norm(s, -INFINITY).equal(tt::norm(ps, -INFINITY)));
  EXPECT_TRUE(tt::norm(s, 0).equal(tt::norm(ps, 0)));
  EXPECT_NEAR(tt::norm(r).item<double>(),
              tt::norm(native([](CT x) { return x.sigmoid() - 0.5; }, p)).item<double>(), bound);
}

TEST_P(Flat, FallsBackWhereFlatWouldDiffer) {
  const TreeTensor p = plain_tree();
  // Autograd: per leaf, and gradients reach the leaves.
  TreeTensor w = tt::consolidate(p);
  w.requires_grad_(true);
  const TreeTensor y = w * 3;
  EXPECT_FALSE(tt::is_consolidated(y));
  tt::sum(y).backward();
  EXPECT_TRUE(std::as_const(w).at("a").leaf().grad().equal(at::full({1025}, 3.0f)));
  {
    at::NoGradGuard no_grad;  // no autograd: flat again
    expect_flat_result(w * 3);
  }
  // A 0-d leaf with a 0-d tensor operand: type promotion differs between leaf and buffer.
  const TreeTensor z =
      tt::consolidate(TreeTensor{{"s", at::scalar_tensor(2.0f)}, {"v", at::ones({3})}});
  const at::Tensor d = at::scalar_tensor(0.5, at::kDouble);
  const TreeTensor zd = z * d;
  EXPECT_FALSE(tt::is_consolidated(zd));
  EXPECT_EQ(std::as_const(zd).at("s").leaf().scalar_type(), at::kDouble);
  expect_flat_result(z * 0.5);
  // Another layout, an unconsolidated operand: per leaf, values right.
  const TreeTensor other = tt::consolidate(like(TreeTensor{{"a", at::zeros({1025})}}));
  EXPECT_THROW(tt::consolidate(p) + other, tt::tree::StructureError);
  EXPECT_FALSE(tt::is_consolidated(tt::consolidate(p) + p));
  expect_same(tt::consolidate(p) + p, native([](CT x) { return x + x; }, p));
}

// Integer buffers: flat for the ops that cannot fail on a value; per leaf for division and
// remainder, which would fail on a zero in the buffer's padding where no leaf has one.
TEST_P(Flat, IntegerTreesRunFlatOnlyWhereNoValueCanFail) {
  const TreeTensor p{{"i", at::arange(1, 6)}, {"j", at::arange(1, 4)}};
  const TreeTensor i = tt::consolidate(p);
  for (const TreeTensor& r :
       {i + 1, i * i, i - i, i.eq(i), tt::maximum(i, i), tt::bitwise_xor(i, i), tt::neg(i),
        tt::clamp(i, 2, 4), tt::where(i.gt(2), i, i), tt::to(i, at::kInt)})
    expect_flat_result(r);  // the registry's integer column and integer_safe hand-written ops
  expect_same(tt::clamp(i, 2, 4), native([](CT x) { return at::clamp(x, 2, 4); }, p));
  expect_same(i + 1, native([](CT x) { return x + 1; }, p));
  expect_same(i * i, native([](CT x) { return x * x; }, p));
  expect_same(tt::bitwise_xor(i, 6), native([](CT x) { return at::bitwise_xor(x, 6); }, p));
  for (const TreeTensor& r : {tt::remainder(i, i), tt::fmod(i, i), tt::pow(i, i)})
    EXPECT_FALSE(tt::is_consolidated(r));
  expect_same(tt::remainder(i, i), native([](CT x) { return at::remainder(x, x); }, p));
  TreeTensor w = tt::consolidate(p);
  w.add_(2);
  EXPECT_TRUE(tt::is_consolidated(w));
  expect_same(w, native([](CT x) { return x + 2; }, p));
}

// A flat call that fails runs per leaf: the error is the per-leaf path's, naming the leaf.
TEST_P(Flat, ErrorsAreThoseOfThePerLeafPath) {
  const TreeTensor p = plain_tree();
  TreeTensor c = tt::consolidate(p);
  TreeTensor q = p;
  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const std::exception& e) {
      const std::string m = e.what();
      return m.substr(0, m.find("\nException raised from"));  // c10's stack trace differs
    }
    return "no error";
  };
  const at::Tensor cplx = at::scalar_tensor(c10::complex<double>(1, 1), at::kComplexDouble);
  const std::string flat = message([&] { c.add_(cplx); });
  const std::string per_leaf = message([&] { q.add_(cplx); });
  EXPECT_NE(flat, "no error");
  EXPECT_EQ(flat, per_leaf);
  EXPECT_TRUE(tt::is_consolidated(c));
  expect_same(c, p);  // nothing written
}

TEST(FlatLayout, ReplacedLeafAndWritesThroughViews) {
  at::manual_seed(3);
  const TreeTensor p = plain_tree();
  TreeTensor c = tt::consolidate(p);
  // A write through a leaf view lands in the buffer, and the next flat op sees it.
  std::as_const(c).at("b.x").leaf()[2].fill_(100);
  EXPECT_TRUE(tt::is_consolidated(c));
  const auto g = tt::consolidated_groups(c)[0];
  EXPECT_EQ(g.buffer[g.ranges[1].first + 2].item<float>(), 100.0f);
  const TreeTensor c1 = c + 1;
  EXPECT_EQ(c1.at("b.x").leaf()[2].item<float>(), 101.0f);
  // Replacing a leaf drops the property; values stay right; consolidate() copies again.
  TreeTensor replaced = c;
  replaced.at("c").leaf() = at::full({1}, 9.0f);
  EXPECT_FALSE(tt::is_consolidated(replaced));
  expect_same(replaced + 1, native([](CT x) { return x + 1; }, replaced));
  const TreeTensor again = tt::consolidate(replaced);
  EXPECT_TRUE(tt::is_consolidated(again));
  expect_same(again, replaced);
  // A mutable access to a tree still laid out in place: the property comes back without a copy.
  TreeTensor touched = c;
  touched.at("a");
  EXPECT_FALSE(tt::is_consolidated(touched));
  const TreeTensor back = tt::consolidate(touched);
  EXPECT_TRUE(std::as_const(back).at("a").leaf().is_same(std::as_const(touched).at("a").leaf()));
}

// consolidate() takes storage the leaves already lie in only when it held a consolidated
// buffer, whose padding belongs to no other tensor (ReplacedLeafAndWritesThroughViews: taken).
TEST(FlatLayout, TakesOnlyStorageNobodyElseSees) {
  // Leaves sliced from a tensor at consolidate's offsets (16 floats = 64 bytes apart): the
  // elements between them are the tensor's data, not padding: copied, and flat writes leave
  // them alone.
  const at::Tensor base = at::arange(19, at::kFloat);
  const TensorTree sliced{{"a", base.narrow(0, 0, 3)}, {"b", base.narrow(0, 16, 3)}};
  TreeTensor c = tt::consolidate(sliced);
  EXPECT_FALSE(std::as_const(c).at("a").leaf().storage().is_alias_of(base.storage()));
  c.mul_(2);
  c.add_(1);
  EXPECT_TRUE(at::equal(base, at::arange(19, at::kFloat)));
  EXPECT_TRUE(at::equal(std::as_const(c).at("b").leaf(), at::arange(16, 19, at::kFloat) * 2 + 1));
  // One storage seen as two dtypes is two groups over one storage: copied into two buffers.
  const at::Tensor x = at::zeros({16}, at::kFloat);
  const TreeTensor two = tt::consolidate(TensorTree{{"f", x}, {"i", x.view(at::kInt)}});
  const auto groups = tt::consolidated_groups(two);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_FALSE(groups[0].buffer.storage().is_alias_of(groups[1].buffer.storage()));
  TreeTensor f = two;
  f.add_(1);
  EXPECT_TRUE(at::equal(std::as_const(f).at("i").leaf(), at::ones({16}, at::kInt)));
  EXPECT_TRUE(at::equal(x, at::zeros({16}, at::kFloat)));
}

TEST(FlatLayout, ConsolidatedConstruction) {
  const tt::ShapeTree shapes = {{"a", {2, 3}}, {"b", {{"x", {7}}, {"y", tt::Shape{}}}}};
  const TreeTensor z = tt::zeros(shapes, at::kDouble, tt::consolidated);
  EXPECT_TRUE(z.is_deferred());
  EXPECT_TRUE(tt::is_consolidated(z));
  expect_same(z, tt::zeros(shapes, at::kDouble));
  expect_same(tt::full(shapes, 2.5, {}, tt::consolidated), tt::full(shapes, 2.5));
  expect_same(tt::ones(shapes, {}, tt::consolidated), tt::ones(shapes));
  EXPECT_EQ(tt::empty(shapes, {}, tt::consolidated).shape(), tt::empty(shapes).shape());
  at::manual_seed(5);
  const TreeTensor r = tt::randn(shapes, {}, tt::consolidated);
  at::manual_seed(5);
  expect_same(r, tt::randn(shapes, {}, tt::consolidated));  // repeats after manual_seed
  EXPECT_TRUE(tt::all(tt::lt(tt::rand(shapes, {}, tt::consolidated), 1)).item<bool>());
  // *_like of a consolidated tree shares its layout: flat ops between them run at once.
  const TreeTensor o = tt::ones_like(r, {}, tt::consolidated);
  EXPECT_EQ(tt::consolidated_source(o)->layout_ptr(), tt::consolidated_source(r)->layout_ptr());
  const TreeTensor sum = r + o;
  EXPECT_TRUE(sum.is_deferred());
  expect_same(sum, native([](CT x) { return x + 1; }, r));
  // *_like of a per-leaf tree, and with another dtype: laid out as consolidate() would.
  const TreeTensor mixed{{"f", at::randn({3})}, {"i", at::arange(4)}};
  const TreeTensor ml = tt::full_like(mixed, 3, {}, tt::consolidated);
  EXPECT_TRUE(tt::is_consolidated(ml));
  expect_same(ml, tt::full_like(mixed, 3));
  const TreeTensor dl = tt::zeros_like(r, at::kDouble, tt::consolidated);
  expect_same(dl, tt::zeros_like(r, at::kDouble));
  // Autograd leaves are made at once and keep their gradients.
  TreeTensor w = tt::randn(shapes, at::TensorOptions().requires_grad(true), tt::consolidated);
  EXPECT_FALSE(w.is_deferred());
  tt::sum(w * 2).backward();
  EXPECT_TRUE(std::as_const(w).at("b.x").leaf().grad().equal(at::full({7}, 2.0f)));
  EXPECT_THROW(tt::zeros({{"a", {-1}}}, {}, tt::consolidated), std::invalid_argument);
  // to(dtype / device) and clone of a consolidated tree are consolidated (one call per buffer).
  const TreeTensor d = r.to(at::kDouble);
  EXPECT_TRUE(d.is_deferred());
  expect_same(d, native([](CT x) { return x.to(at::kDouble); }, r));
  EXPECT_TRUE(tt::is_consolidated(r.to(at::Device(at::kCPU))));
  EXPECT_TRUE(tt::is_consolidated(r.clone()));
}

// A buffer over 1 MiB is updated in pieces the runtime may spread over lanes (element ranges);
// values are those of the per-leaf loop under every strategy.
TEST_P(Flat, LargeBufferInPlaceRunsInPieces) {
  const TreeTensor p{
      {"big", at::randn({300001})}, {"small", at::randn({3, 5})}, {"wide", at::randn({2, 70000})}};
  const TreeTensor q = like(p);
  TreeTensor c = tt::consolidate(p);
  const TreeTensor cq = tt::consolidate(q);
  c.add_(cq, 0.5);
  c.mul_(3);
  expect_same(c, native([](CT x, CT y) { return (x + 0.5 * y) * 3; }, p, q));
  c.sigmoid_();
  expect_within_ulps(c, native([](CT x, CT y) { return ((x + 0.5 * y) * 3).sigmoid(); }, p, q));
  c.copy_(c);  // the target read as its own source: one buffer, still split safely
  EXPECT_TRUE(tt::is_consolidated(c));
}

// adam_step (the at:: tree form) on consolidated trees runs flat: every stage one call per
// buffer, the same at:: calls as the per-leaf loop, so the same bits.
TEST_P(Flat, AdamStepOnConsolidatedTreesIsThePerLeafLoop) {
  const TreeTensor p = plain_tree(), g = like(p);
  const TreeTensor m0 = native([](CT x) { return x.abs() * 0.1; }, p);
  const TreeTensor v0 = native([](CT x) { return x.abs() * 0.01; }, p);
  const tt::AdamOptions o = tt::AdamOptions().lr(1e-2).weight_decay(0.1);
  TreeTensor cp = tt::consolidate(p), cm = tt::consolidate(m0), cv = tt::consolidate(v0);
  const TreeTensor cg = tt::consolidate(g);
  TreeTensor np = p.clone(), nm = m0.clone(), nv = v0.clone();
  {
    rt::StreamGuard linear(rt::StreamMode::of(1));
    np = tt::tree::map([](CT x) { return x.clone(); }, p);
    nm = tt::tree::map([](CT x) { return x.clone(); }, m0);
    nv = tt::tree::map([](CT x) { return x.clone(); }, v0);
  }
  for (int64_t step = 1; step <= 3; ++step) {
    tt::adam_step(cp, cg, cm, cv, step, o);
    rt::StreamGuard linear(rt::StreamMode::of(1));
    tt::adam_step(np, g, nm, nv, step, o);
  }
  EXPECT_TRUE(tt::is_consolidated(cp));
  EXPECT_TRUE(cp.is_deferred()) << "no leaf was made: the step ran on the buffers";
  expect_same(cp, np);
  expect_same(cm, nm);
  expect_same(cv, nv);
}

INSTANTIATE_TEST_SUITE_P(Strategies, Flat, ::testing::ValuesIn(strategies()), strategy_name);
