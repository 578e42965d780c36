// Fused tree expressions (DESIGN.md §19): fuse(f, trees...) gives, under every execution
// strategy, the values of f applied op at a time to the trees — bitwise for correctly rounded
// ops, within the libm bound (8 ulp, as tensor_flat_test derives it) for sigmoid — on leaves of
// different sizes, tile boundaries inside leaves, non-contiguous leaves, mixed dtypes,
// broadcast operands, consolidated trees; autograd, asyncs scopes and errors as tree calls.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <set>
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
using CT = const at::Tensor&;

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

// Leaves of n = 1, 7, 33 and 1025 elements (vector tails of every ISA) of `dtype`, whose first
// values are the special ones: NaN, ±inf, ±0, a denormal, the largest finite, ±1, and
// values where exp and sigmoid saturate.
TreeTensor special_values(at::ScalarType dtype) {
  const double inf = std::numeric_limits<double>::infinity();
  const double big = dtype == at::kDouble ? 1.7e308 : 3.4e38;
  const double denormal = dtype == at::kDouble ? 4.9e-324 : 1.4e-45;
  const std::vector<double> special{std::nan(""), inf,  -inf, 0.0,   -0.0,  denormal, big, -big,
                                    1.0,          -1.0, 90.0, -90.0, 710.0, -750.0,   0.5};
  auto leaf = [&](int64_t n) {
    at::Tensor t = at::randn({n}, at::TensorOptions().dtype(at::kDouble)) * 4;
    for (int64_t i = 0; i < std::min<int64_t>(n, int64_t(special.size())); ++i)
      t[(i * 5) % n] = special[static_cast<std::size_t>(i)];
    return t.to(dtype);
  };
  return TreeTensor{{"a", leaf(1)}, {"b", leaf(7)}, {"c", leaf(33)}, {"d", leaf(1025)}};
}

// Bit for bit (zero signs included), except that a NaN matches any NaN: torch promises no NaN
// payloads, and ATen's own kernels give other ones in a tensor's scalar tail than in its body.
// The one-pass ops that are IEEE operations compute what ATen's kernels compute.
void expect_bitwise(const TensorTree& got, const TensorTree& want) {
  ASSERT_EQ(paths(got), paths(want));
  const auto g = leaves(got), w = leaves(want);
  for (std::size_t i = 0; i < g.size(); ++i) {
    SCOPED_TRACE("leaf " + paths(want)[i]);
    ASSERT_EQ(g[i].scalar_type(), w[i].scalar_type());
    if (!at::isFloatingType(w[i].scalar_type())) {
      EXPECT_TRUE(at::equal(g[i], w[i])) << g[i] << "\nvs\n" << w[i];
      continue;
    }
    const at::ScalarType bits = w[i].scalar_type() == at::kDouble ? at::kLong : at::kInt;
    const at::Tensor nan = g[i].isnan() & w[i].isnan();
    const at::Tensor gb = g[i].contiguous().view(bits).masked_fill(nan, 0);
    const at::Tensor wb = w[i].contiguous().view(bits).masked_fill(nan, 0);
    EXPECT_TRUE(at::equal(gb, wb)) << g[i] << "\nvs\n" << w[i];
  }
}

// The names of the ATen ops called on any thread while it lives.
class OpsCalled {
 public:
  OpsCalled() {
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(
        [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          const std::lock_guard<std::mutex> lock(mutex());
          names().insert(fn.name());
          return nullptr;
        }));
  }
  ~OpsCalled() {
    at::removeCallback(handle_);
    names().clear();
  }
  OpsCalled(const OpsCalled&) = delete;
  OpsCalled& operator=(const OpsCalled&) = delete;
  bool any(std::initializer_list<std::string> of) const {
    const std::lock_guard<std::mutex> lock(mutex());
    for (const std::string& n : of)
      if (names().count(n)) return true;
    return false;
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::set<std::string>& names() {
    static std::set<std::string> n;
    return n;
  }
  at::CallbackHandle handle_;
};

}  // namespace

TEST_P(Fuse, OnePassOpsEqualATenOnSpecialValues) {
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    SCOPED_TRACE(c10::toString(dtype));
    const TreeTensor x = special_values(dtype), y = like(x);
    for (std::int64_t bytes : {std::int64_t{1}, std::int64_t{64} << 10}) {
      const FuseOptions o = FuseOptions().tile(bytes);
      auto ieee = [](const auto& a, const auto& b) {
        auto t = (a + b) * (a - b) / b;
        t = t.maximum(a.neg()).minimum(b.abs());
        return t.reciprocal().square().relu() - a / 3 + (2 - b) * 16777217 + a * true;
      };
      expect_bitwise(tt::fuse(o, ieee, x, y), ieee(x, y));
      const auto exp = [](const auto& a) { return a.exp(); };
      const auto log = [](const auto& a) { return a.log(); };
      const auto tanh = [](const auto& a) { return a.tanh(); };
      const auto sigmoid = [](const auto& a) { return a.sigmoid(); };
      expect_within_ulps(tt::fuse(o, exp, x), exp(x));
      expect_within_ulps(tt::fuse(o, log, x), log(x));
      expect_within_ulps(tt::fuse(o, tanh, x), tanh(x));
      expect_within_ulps(tt::fuse(o, sigmoid, x), sigmoid(x));
    }
  }
}

TEST_P(Fuse, FloatChainsOfOnePassOpsCallNoATenOp) {
  const TreeTensor x = mixed_sizes(), y = like(x);
  {
    const OpsCalled calls;
    expect_within_ulps(tt::fuse(sigmoid_chain, x, y), sigmoid_chain(x, y));
    // The eager chain above calls them; fuse() must not have (checked after both ran, so the
    // recorder is seen to work).
    EXPECT_TRUE(calls.any({"aten::sigmoid_"}));
  }
  {
    const OpsCalled calls;
    (void)tt::fuse(sigmoid_chain, x, y);
    EXPECT_FALSE(calls.any({"aten::mul", "aten::add", "aten::sigmoid_", "aten::sigmoid"}));
  }
  {
    const OpsCalled calls;
    (void)tt::fuse(rounded_chain, x, y);  // add with alpha -2: ATen op by op
    EXPECT_TRUE(calls.any({"aten::add", "aten::add.out"}));
  }
}

// Plain tree calls of the exact ops run each float or int leaf through the one-pass kernel instead
// of ATen's dispatcher (fuse_kernels.hpp): bitwise ATen's values, ATen where autograd must record.
TEST_P(Fuse, TreeOpsOnPlainLeavesGiveATensValuesWithoutATen) {
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    SCOPED_TRACE(c10::toString(dtype));
    const TreeTensor x = special_values(dtype), y = like(x);
    const OpsCalled calls;
    expect_bitwise(x + y, native([](CT a, CT b) { return a + b; }, x, y));
    expect_bitwise(x - y, native([](CT a, CT b) { return a - b; }, x, y));
    expect_bitwise(x * y, native([](CT a, CT b) { return a * b; }, x, y));
    expect_bitwise(x / y, native([](CT a, CT b) { return a / b; }, x, y));
    expect_bitwise(x.maximum(y), native([](CT a, CT b) { return a.maximum(b); }, x, y));
    expect_bitwise(x.minimum(y), native([](CT a, CT b) { return a.minimum(b); }, x, y));
    expect_bitwise(x + 1, native([](CT a) { return a + 1; }, x));
    expect_bitwise(x * 2.5, native([](CT a) { return a * 2.5; }, x));
    expect_bitwise(x - 16777217, native([](CT a) { return a - 16777217; }, x));
    expect_bitwise(x / 3, native([](CT a) { return a / 3; }, x));
    expect_bitwise(x * true, native([](CT a) { return a * true; }, x));
    expect_bitwise(x + 1e300, native([](CT a) { return a + 1e300; }, x));  // inf in float
    EXPECT_THROW((void)(x - true), c10::Error);
    EXPECT_THROW((void)x.add(y, true), c10::Error);
    EXPECT_THROW((void)tt::fuse([](const auto& p) { return p - true; }, x), c10::Error);
    EXPECT_THROW((void)tt::fuse([](const auto& p, const auto& q) { return p.add(q, true); }, x, y),
                 c10::Error);
    expect_bitwise(-x, native([](CT a) { return -a; }, x));
    expect_bitwise(x.abs(), native([](CT a) { return a.abs(); }, x));
    expect_bitwise(x.reciprocal(), native([](CT a) { return a.reciprocal(); }, x));
    expect_bitwise(x.square(), native([](CT a) { return a.square(); }, x));
    expect_bitwise(x.relu(), native([](CT a) { return a.relu(); }, x));
    EXPECT_TRUE(calls.any({"aten::add"}));  // the hand-written loops' calls are seen
  }
  // Integer leaves: the wrapping ops, with the extremes that wrap.
  for (const at::ScalarType dtype : {at::kLong, at::kInt}) {
    SCOPED_TRACE(c10::toString(dtype));
    const int64_t lo = dtype == at::kLong ? std::numeric_limits<int64_t>::min() : INT32_MIN;
    const int64_t hi = dtype == at::kLong ? std::numeric_limits<int64_t>::max() : INT32_MAX;
    auto leaf = [&](int64_t n) {
      at::Tensor t = at::randint(-1000, 1000, {n}, at::TensorOptions().dtype(dtype));
      t[0] = lo;
      if (n > 1) t[n - 1] = hi;
      return t;
    };
    const TreeTensor a{{"a", leaf(1)}, {"b", leaf(7)}, {"c", leaf(33)}, {"d", leaf(1025)}};
    const TreeTensor b = tt::tree::map([](CT t) { return at::randint_like(t, -70000, 70000); }, a);
    expect_bitwise(a + b, native([](CT p, CT q) { return p + q; }, a, b));
    expect_bitwise(a - b, native([](CT p, CT q) { return p - q; }, a, b));
    expect_bitwise(a * b, native([](CT p, CT q) { return p * q; }, a, b));
    expect_bitwise(a.maximum(b), native([](CT p, CT q) { return p.maximum(q); }, a, b));
    expect_bitwise(a.minimum(b), native([](CT p, CT q) { return p.minimum(q); }, a, b));
    expect_bitwise(a * 3000000000LL, native([](CT p) { return p * 3000000000LL; }, a));
    expect_bitwise(a * true, native([](CT p) { return p * true; }, a));
    expect_bitwise(a + (int64_t{1} << 40), native([](CT p) { return p + (int64_t{1} << 40); }, a));
    // ATen's own refusals stand: no bool in a subtraction, no bool alpha.
    EXPECT_THROW((void)(a - true), c10::Error);
    EXPECT_THROW((void)a.add(b, true), c10::Error);
    EXPECT_THROW((void)a.add(b, 1.0), c10::Error);  // a floating alpha for integers
    expect_bitwise(-a, native([](CT p) { return -p; }, a));
    expect_bitwise(a.abs(), native([](CT p) { return p.abs(); }, a));
    expect_bitwise(a.square(), native([](CT p) { return p.square(); }, a));
    expect_bitwise(a.relu(), native([](CT p) { return p.relu(); }, a));
    expect_bitwise(a / b, native([](CT p, CT q) { return p / q; }, a, b));  // floats: ATen
    expect_bitwise(a + 0.5, native([](CT p) { return p + 0.5; }, a));       // floats: ATen
  }
  const TreeTensor x = special_values(at::kFloat), y = like(x);
  auto tree_calls_aten = [](const auto& call, std::initializer_list<std::string> names) {
    const OpsCalled calls;
    (void)call();
    return calls.any(names);
  };
  EXPECT_FALSE(tree_calls_aten([&] { return x + y; }, {"aten::add"}));
  EXPECT_FALSE(tree_calls_aten([&] { return x * 2; }, {"aten::mul"}));
  EXPECT_FALSE(tree_calls_aten([&] { return x.relu(); }, {"aten::relu", "aten::clamp_min"}));
  // Where the one-pass kernel would not give ATen's exact result or metadata: ATen.
  EXPECT_TRUE(tree_calls_aten([&] { return x.sub(y, 2); }, {"aten::sub"}));  // alpha: FMA
  EXPECT_TRUE(tree_calls_aten([&] { return x.sqrt(); }, {"aten::sqrt"}));    // not IEEE in ATen
  EXPECT_TRUE(tree_calls_aten([&] { return x.sigmoid(); }, {"aten::sigmoid"}));
  EXPECT_TRUE(tree_calls_aten([&] { return x + x.to(at::kDouble); }, {"aten::add"}));
  const TreeTensor ints = tt::tree::map([](CT t) { return t.nan_to_num().to(at::kLong); }, x);
  EXPECT_FALSE(tree_calls_aten([&] { return ints + 1; }, {"aten::add"}));
  EXPECT_TRUE(tree_calls_aten([&] { return ints / 2; }, {"aten::div"}));    // gives floats
  EXPECT_TRUE(tree_calls_aten([&] { return ints * 1.5; }, {"aten::mul"}));  // promotes
  const TreeTensor halves = tt::tree::map([](CT t) { return t.to(at::kHalf); }, x);
  EXPECT_TRUE(tree_calls_aten([&] { return halves + 1; }, {"aten::add"}));
  const TreeTensor wide{{"a", at::randn({3, 4})}}, row{{"a", at::randn({4})}};
  EXPECT_TRUE(tree_calls_aten([&] { return wide * row; }, {"aten::mul"}));  // broadcasting
  EXPECT_TRUE(tree_calls_aten([&] { return 2 - x; }, {"aten::sub"}));       // number first
  // ATen's result keeps a size-1 dimension's free stride (a transposed row): ATen makes it.
  const TreeTensor column{{"a", at::randn({1, 3}).t()}};
  EXPECT_TRUE(tree_calls_aten([&] { return column + 1; }, {"aten::add"}));
  EXPECT_EQ((column + 1).at("a").leaf().strides(), (column.at("a").leaf() + 1).strides());
  // A leaf over one grain on a caller with several intra-op threads keeps ATen's parallelism.
  {
    const rt::StreamGuard linear(std::size_t{1});
    const TreeTensor big{{"a", at::randn({at::internal::GRAIN_SIZE + 1})}};
    EXPECT_EQ(tree_calls_aten([&] { return big * 2; }, {"aten::mul"}), at::get_num_threads() > 1);
  }
  // Autograd: a leaf that requires grad goes to ATen under grad mode, so the graph is made...
  TreeTensor g = tt::tree::map([](CT t) { return t.detach().clone().requires_grad_(); }, x);
  const TreeTensor r = g * 3;
  for (const auto& l : leaves(r)) EXPECT_TRUE(l.requires_grad() && l.grad_fn());
  // ...and without grad mode the result needs none, as ATen gives it.
  {
    const at::NoGradGuard no_grad;
    EXPECT_FALSE(tree_calls_aten([&] { return g * 3; }, {"aten::mul"}));
    for (const auto& l : leaves(g * 3)) EXPECT_FALSE(l.requires_grad());
  }
  {
    const c10::InferenceMode inference;
    for (const auto& l : leaves(x + y)) EXPECT_TRUE(l.is_inference());
  }
}

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
