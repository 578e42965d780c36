// TreeTensor basics: construction, conversion, printing, structure errors, leaf errors with
// path and op, in-place identity and partial-update reports, apply, attributes (issue 3).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <map>
#include <sstream>
#include <stdexcept>
#include <string>

#include "tensor_test_util.hpp"
#include "treetensor/tensor/tensor.hpp"

namespace tt = treetensor;
using namespace tt_test;
using at::indexing::Slice;
using tt::TreeTensor;

namespace {

TreeTensor sample() {
  return TreeTensor{{"a", at::tensor({1.0f, 2.0f, 1.5f})},
                    {"b", TensorTree{{"x", at::tensor({1.8f, 0.9f, 1.3f, 2.5f}).view({2, 2})}}}};
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST(TensorConstruct, FromShapesHasShapesDtypeAndOptions) {
  TreeTensor t = tt::randn({{"a", {2, 3}}, {"b", {{"x", {3, 4}}}}});
  EXPECT_EQ(paths(t), (std::vector<std::string>{"a", "b.x"}));
  EXPECT_EQ(t.at("a").leaf().sizes(), (at::IntArrayRef{2, 3}));
  EXPECT_EQ(t.at("b.x").leaf().sizes(), (at::IntArrayRef{3, 4}));
  EXPECT_EQ(tt::single(t.dtype()), at::kFloat);

  TreeTensor z = tt::zeros({{"a", {2}}, {"b", tt::Shape{}}}, at::TensorOptions(at::kDouble));
  EXPECT_EQ(tt::single(z.dtype()), at::kDouble);
  EXPECT_EQ(z.at("b").leaf().dim(), 0);
  EXPECT_TRUE(at::equal(z.at("a").leaf(), at::zeros({2}, at::kDouble)));
  TreeTensor o = tt::ones({{"a", {2}}}, at::TensorOptions().requires_grad(true));
  EXPECT_TRUE(o.at("a").leaf().requires_grad());
  EXPECT_TRUE(o.at("a").leaf().is_leaf());
  TreeTensor f = tt::full({{"a", {2}}, {"b", {1, 1}}}, 7);
  EXPECT_TRUE(at::equal(f.at("b").leaf(), at::full({1, 1}, 7)));
  EXPECT_EQ(tt::empty({{"a", {0, 3}}}).at("a").leaf().numel(), 0);
  TreeTensor r = tt::arange({{"a", 3}, {"b", 2.5}});
  EXPECT_TRUE(at::equal(r.at("a").leaf(), at::arange(3)));
  EXPECT_TRUE(at::equal(r.at("b").leaf(), at::arange(2.5)));
}

TEST(TensorConstruct, RandomIsReproducibleAndInRange) {
  const tt::ShapeTree shapes = {{"a", {20, 3}}, {"b", {{"x", {30}}}}};
  at::manual_seed(5);
  TreeTensor a = tt::randn(shapes);
  at::manual_seed(5);
  TreeTensor b = tt::randn(shapes);
  EXPECT_TRUE(tt::equal(a, b));
  EXPECT_FALSE(at::equal(a.at("a").leaf().flatten().narrow(0, 0, 30), b.at("b.x").leaf()))
      << "leaves must come from different seeds";
  TreeTensor u = tt::rand(shapes);
  EXPECT_TRUE(tt::all(u.ge(0) & u.lt(1)).item<bool>());
  TreeTensor i = tt::randint(3, 7, shapes);
  EXPECT_EQ(tt::single(i.dtype()), at::kLong);
  EXPECT_EQ(tt::min(i).item<int64_t>(), 3);
  EXPECT_EQ(tt::max(i).item<int64_t>(), 6);
}

TEST(TensorConstruct, LikeFormsKeepShapesAndTakeOptions) {
  TreeTensor t = sample();
  TreeTensor z = tt::zeros_like(t);
  EXPECT_EQ(z.shape(), t.shape());
  EXPECT_TRUE(tt::equal(z, native([](const at::Tensor& x) { return at::zeros_like(x); }, t)));
  EXPECT_EQ(tt::single(tt::ones_like(t, at::kDouble).dtype()), at::kDouble);
  EXPECT_TRUE(tt::equal(tt::full_like(t, 2.5),
                        native([](const at::Tensor& x) { return at::full_like(x, 2.5); }, t)));
  EXPECT_EQ(tt::empty_like(t).shape(), t.shape());
  at::manual_seed(1);
  TreeTensor r1 = tt::randn_like(t);
  at::manual_seed(1);
  EXPECT_TRUE(tt::equal(r1, tt::randn_like(t)));
  EXPECT_EQ(tt::rand_like(t).shape(), t.shape());
  TreeTensor ri = tt::randint_like(t, 0, 2, at::kLong);
  EXPECT_TRUE(tt::all(ri.ge(0) & ri.lt(2)).item<bool>());
}

TEST(TensorConstruct, FromValuesAndScalars) {
  TreeTensor t = tt::tensor({{"a", {1, 2, 3}}, {"b", {{"x", {0.5}}}}});
  EXPECT_TRUE(at::equal(t.at("a").leaf(), at::tensor({1.0f, 2.0f, 3.0f})));
  EXPECT_EQ(t.at("b.x").leaf().scalar_type(), at::kFloat);
  TreeTensor s = tt::scalars({{"i", 3}, {"f", 1.5}, {"b", true}});
  EXPECT_EQ(s.at("i").leaf().scalar_type(), at::kLong);
  EXPECT_EQ(s.at("f").leaf().scalar_type(), at::kFloat);
  EXPECT_EQ(s.at("b").leaf().scalar_type(), at::kBool);
  EXPECT_EQ(s.at("i").leaf().dim(), 0);
}

TEST(TensorConvert, StateDictRoundTripSharesTensors) {
  std::map<std::string, at::Tensor> sd = {{"layer1.0.conv1.weight", at::randn({2, 2})},
                                          {"layer1.0.bn1.bias", at::randn({2})},
                                          {"fc.bias", at::randn({3})}};
  TreeTensor t = tt::from_state_dict(sd);
  EXPECT_EQ(paths(t),
            (std::vector<std::string>{"fc.bias", "layer1.0.bn1.bias", "layer1.0.conv1.weight"}));
  EXPECT_TRUE(t.at("layer1.0.conv1.weight").leaf().is_same(sd["layer1.0.conv1.weight"]));
  auto back = tt::to_state_dict(t);
  ASSERT_EQ(back.size(), sd.size());
  for (const auto& [k, v] : sd) EXPECT_TRUE(back.at(k).is_same(v)) << k;
  EXPECT_THROW(tt::from_state_dict(
                   std::map<std::string, at::Tensor>{{"a", at::ones(1)}, {"a.b", at::ones(1)}}),
               tt::tree::StructureError);
}

TEST(TensorConvert, StateDictRejectsKeysDottedFormCannotName) {
  // A key with '.' or an empty key would come back as another tree: refuse, naming it.
  const TreeTensor dotted({{"a.b", at::ones({2})}});
  try {
    tt::to_state_dict(dotted);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'a.b'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(tt::to_state_dict(TreeTensor({{"", at::ones({2})}})), std::invalid_argument);
  for (const char* key : {"a..b", ".a", "a."})
    EXPECT_THROW(tt::from_state_dict(std::map<std::string, at::Tensor>{{key, at::ones(1)}}),
                 std::invalid_argument)
        << key;
  EXPECT_THROW(
      tt::from_state_dict(std::map<std::string, at::Tensor>{{"", at::ones(1)}, {"b", at::ones(1)}}),
      std::invalid_argument);
  // A lone "" is a leaf root and round-trips.
  const TreeTensor root = tt::from_state_dict(std::map<std::string, at::Tensor>{{"", at::ones(1)}});
  EXPECT_TRUE(root.is_leaf());
  EXPECT_EQ(tt::to_state_dict(root).count(""), 1u);
}

TEST(TensorConvert, IValueNestsBothWays) {
  c10::Dict<std::string, at::Tensor> inner;
  inner.insert("x", at::ones({2}));
  c10::impl::GenericDict outer(c10::StringType::get(), c10::AnyType::get());
  outer.insert("a", at::zeros({1}));
  outer.insert("b", inner);
  TreeTensor t = tt::from_ivalue(outer);
  EXPECT_EQ(paths(t), (std::vector<std::string>{"a", "b.x"}));
  EXPECT_TRUE(t.at("b.x").leaf().is_same(inner.at("x")));
  TreeTensor again = tt::from_ivalue(tt::to_ivalue(t));
  EXPECT_TRUE(tt::equal(again, t));
  EXPECT_TRUE(again.at("a").leaf().is_same(t.at("a").leaf()));

  c10::impl::GenericDict bad(c10::StringType::get(), c10::AnyType::get());
  bad.insert("n", 3);
  c10::impl::GenericDict top(c10::StringType::get(), c10::AnyType::get());
  top.insert("k", bad);
  try {
    tt::from_ivalue(top);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_TRUE(contains(e.what(), "'k.n'")) << e.what();
  }
}

TEST(TensorConvert, FlattenUnflattenIsZeroCopy) {
  TreeTensor t = sample();
  auto flat = tt::tree::flatten(t);
  TreeTensor back = tt::tree::unflatten(flat.spec, flat.leaves);
  EXPECT_TRUE(back.at("b.x").leaf().is_same(t.at("b.x").leaf()));
  TreeTensor same = tt::to(t, at::kFloat);
  EXPECT_TRUE(same.at("a").leaf().is_same(t.at("a").leaf())) << "to() must not copy";
  EXPECT_TRUE(t.contiguous().at("a").leaf().is_same(t.at("a").leaf()));
  TreeTensor c = t.clone();
  EXPECT_FALSE(c.at("a").leaf().is_same(t.at("a").leaf()));
  EXPECT_TRUE(tt::equal(c, t));
  EXPECT_EQ(tt::single(t.to(at::kDouble).dtype()), at::kDouble);
  EXPECT_EQ(tt::single(t.cpu().device()), at::Device(at::kCPU));
}

TEST(TensorPrint, TreetensorLayout) {
  TreeTensor t{{"a", at::tensor({1.0f, 2.0f, 3.0f})},
               {"b", TensorTree{{"x", at::arange(1, 5).view({2, 2})}}}};
  std::ostringstream os;
  os << t;
  EXPECT_EQ(os.str(),
            "<TreeTensor>\n"
            "├── a --> tensor([1., 2., 3.])\n"
            "└── b --> <TreeTensor>\n"
            "    └── x --> tensor([[1, 2],\n"
            "                      [3, 4]])");
}

TEST(TensorPrint, TensorReprMatchesPytorch) {
  EXPECT_EQ(tt::format_tensor(at::tensor({0.5, -1.25})),
            "tensor([ 0.5000, -1.2500], dtype=torch.float64)");
  EXPECT_EQ(tt::format_tensor(at::scalar_tensor(3.5)), "tensor(3.5000)");
  EXPECT_EQ(tt::format_tensor(at::tensor({1, 0}).to(at::kBool)), "tensor([ True, False])");
  EXPECT_EQ(tt::format_tensor(at::zeros({0, 3})), "tensor([], size=(0, 3))");
  EXPECT_EQ(tt::format_tensor(at::ones({2}).requires_grad_()),
            "tensor([1., 1.], requires_grad=True)");
  EXPECT_EQ(tt::format_tensor(at::tensor({1e-5f, 1.0f})), "tensor([1.0000e-05, 1.0000e+00])");
  const std::string big = tt::format_tensor(at::arange(2000));
  EXPECT_TRUE(contains(big, "0,    1,    2,  ..., 1997, 1998, 1999")) << big;
  // Complex: the real parts padded to their width, the imaginary parts signed (torch's format).
  using cf = c10::complex<float>;
  EXPECT_EQ(tt::format_tensor(at::tensor({cf(1, 1), cf(2, -10)})), "tensor([1.+1.j, 2.-10.j])");
  EXPECT_EQ(tt::format_tensor(at::tensor({cf(1.5, 2), cf(-0.25, -1)}).to(at::kComplexDouble)),
            "tensor([ 1.5000+2.j, -0.2500-1.j], dtype=torch.complex128)");
  EXPECT_EQ(tt::format_tensor(at::scalar_tensor(c10::complex<double>(3, 4), at::kComplexFloat)),
            "tensor(3.+4.j)");
  // With a float64 default, complex128 is the unnamed complex dtype and an empty float64 tensor
  // names none (torch's repr).
  const auto before = at::get_default_dtype();
  at::set_default_dtype(caffe2::TypeMeta::Make<double>());
  EXPECT_EQ(tt::format_tensor(at::tensor({cf(1, 1)}).to(at::kComplexDouble)), "tensor([1.+1.j])");
  EXPECT_EQ(tt::format_tensor(at::tensor({cf(1, 1)})), "tensor([1.+1.j], dtype=torch.complex64)");
  EXPECT_EQ(tt::format_tensor(at::zeros({0}, at::kDouble)), "tensor([])");
  EXPECT_EQ(tt::format_tensor(at::zeros({0}, at::kFloat)), "tensor([], dtype=torch.float32)");
  at::set_default_dtype(before);
  // Widths from the nonzero finite elements; a summarised tensor's format from those shown.
  EXPECT_EQ(tt::format_tensor(at::tensor({0.0f, NAN})), "tensor([0., nan])");
  at::Tensor shown = at::arange(2000, at::kFloat);
  shown[1000] = 0.5;
  EXPECT_TRUE(contains(tt::format_tensor(shown),
                       "tensor([0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., "
                       "1.9970e+03, 1.9980e+03,"));
}

TEST(TensorPrint, BuildingNeverFormatsTensors) {
  // A tensor whose formatting would throw: building, converting and zipping must not touch it.
  at::Tensor meta = at::empty({2, 2}, at::TensorOptions().device(at::kMeta));
  TreeTensor t{{"m", meta}};
  TreeTensor u = tt::from_state_dict(tt::to_state_dict(t));
  TreeTensor v = tt::from_ivalue(tt::to_ivalue(u));
  EXPECT_TRUE(v.at("m").leaf().is_same(meta));
}

TEST(TensorOps, OperatorsMatchNativeLoop) {
  at::manual_seed(0);
  TreeTensor a = randn_tree({{"a", {2, 3}}, {"b", {{"x", {4}}, {"y", tt::Shape{}}}}});
  TreeTensor b = randn_tree({{"a", {2, 3}}, {"b", {{"x", {4}}, {"y", tt::Shape{}}}}});
  expect_same(a + b, native([](auto& x, auto& y) { return x + y; }, a, b));
  expect_same(a - b, native([](auto& x, auto& y) { return x - y; }, a, b));
  expect_same(a * b, native([](auto& x, auto& y) { return x * y; }, a, b));
  expect_same(a / b, native([](auto& x, auto& y) { return x / y; }, a, b));
  expect_same(a % b, native([](auto& x, auto& y) { return at::remainder(x, y); }, a, b));
  expect_same(-a, native([](auto& x) { return -x; }, a));
  expect_same(a + 1.5, native([](auto& x) { return x + 1.5; }, a));
  expect_same(2 - a, native([](auto& x) { return 2 - x; }, a));
  expect_same(2.0 / a, native([](auto& x) { return 2.0 / x; }, a));
  at::Tensor s = at::randn({});
  expect_same(a * s, native([&](auto& x) { return x * s; }, a));
  expect_same(a < b, native([](auto& x, auto& y) { return x < y; }, a, b));
  expect_same(a >= 0, native([](auto& x) { return x >= 0; }, a));
  expect_same(a == a, native([](auto& x) { return x == x; }, a));
  expect_same(a != b, native([](auto& x, auto& y) { return x != y; }, a, b));

  TreeTensor i = tt::randint(0, 100, {{"p", {5}}, {"q", {{"r", {2, 2}}}}});
  TreeTensor j = tt::randint(1, 100, {{"p", {5}}, {"q", {{"r", {2, 2}}}}});
  expect_same(i & j, native([](auto& x, auto& y) { return x & y; }, i, j));
  expect_same(i | j, native([](auto& x, auto& y) { return x | y; }, i, j));
  expect_same(i ^ j, native([](auto& x, auto& y) { return x ^ y; }, i, j));
  expect_same(~i, native([](auto& x) { return ~x; }, i));
  expect_same(i % j, native([](auto& x, auto& y) { return x % y; }, i, j));
  expect_same(i + 0.5, native([](auto& x) { return x + 0.5; }, i));
}

TEST(TensorOps, CompoundAssignmentKeepsLeafTensors) {
  at::manual_seed(1);
  TreeTensor a = randn_tree({{"a", {3}}, {"b", {{"x", {2, 2}}}}});
  TreeTensor b = randn_tree({{"a", {3}}, {"b", {{"x", {2, 2}}}}});
  const TreeTensor before = a.clone();
  const at::Tensor a_leaf = a.at("a").leaf();
  const void* data = a_leaf.data_ptr();
  a += b;
  EXPECT_TRUE(a.at("a").leaf().is_same(a_leaf));
  EXPECT_EQ(a.at("a").leaf().data_ptr(), data);
  expect_same(a, native([](auto& x, auto& y) { return x + y; }, before, b));
  a *= 2;
  a -= b;
  a /= 4;
  auto want = native([](auto& x, auto& y) { return ((x + y) * 2 - y) / 4; }, before, b);
  expect_same(a, want);
  EXPECT_TRUE(a.at("a").leaf().is_same(a_leaf));
}

TEST(TensorErrors, StructureMismatchNamesPathPositionsAndKeys) {
  TreeTensor a{{"a", at::ones(2)}, {"b", TensorTree{{"x", at::ones(2)}, {"y", at::ones(2)}}}};
  TreeTensor b{{"a", at::ones(2)}, {"b", TensorTree{{"x", at::ones(2)}, {"z", at::ones(2)}}}};
  try {
    (void)tt::add(a, b);
    FAIL();
  } catch (const tt::tree::StructureError& e) {
    EXPECT_EQ(std::string(e.what()),
              "add: key mismatch at 'b': argument 0 has keys {x, y}, argument 1 has keys {x, z}");
    EXPECT_EQ(e.path().str(), "b");
  }
  TreeTensor c{{"a", at::ones(2)}, {"b", at::ones(2)}};
  try {
    (void)tt::where(a > 0, 1.0, c);  // position 2 is a leaf where position 0 has a subtree
    FAIL();
  } catch (const tt::tree::StructureError& e) {
    EXPECT_TRUE(contains(e.what(),
                         "where: at 'b' argument 2 is a leaf but argument 0 is a subtree with "
                         "keys {x, y}"))
        << e.what();
  }
  EXPECT_THROW((void)tt::add(at::ones(1), 2), std::invalid_argument);
}

TEST(TensorErrors, LeafErrorNamesPathAndOpKeepsTorchMessageAndType) {
  TreeTensor a{{"a", at::ones({2, 3})}, {"b", TensorTree{{"x", at::ones({2, 3})}}}};
  TreeTensor b{{"a", at::ones({3, 2})}, {"b", TensorTree{{"x", at::ones({4, 2})}}}};
  try {
    (void)tt::matmul(a, b);
    FAIL();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_TRUE(contains(msg, "matmul at leaf 'b.x'")) << msg;
    EXPECT_TRUE(contains(msg, "cannot be multiplied")) << msg;
  }
}

TEST(TensorErrors, FailedInPlaceUpdateSaysWhichLeavesWereUpdated) {
  TreeTensor a{{"a", at::zeros({3})}, {"b", at::zeros({3})}, {"c", at::zeros({3})}};
  TreeTensor b{{"a", at::ones({3})}, {"b", at::ones({4})}, {"c", at::ones({3})}};
  try {
    a += b;
    FAIL();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_TRUE(contains(msg, "in-place add_ updated 2 of 3 leaves {a, c}, not updated {b}"))
        << msg;
    EXPECT_TRUE(contains(msg, "add_ at leaf 'b'")) << msg;
  }
  EXPECT_TRUE(at::equal(a.at("a").leaf(), at::ones({3})));
  EXPECT_TRUE(at::equal(a.at("b").leaf(), at::zeros({3})));
  EXPECT_TRUE(at::equal(a.at("c").leaf(), at::ones({3})));
}

TEST(TensorApply, AnyFunctionLeafWise) {
  at::manual_seed(2);
  TreeTensor a = randn_tree({{"a", {2, 5}}, {"b", {{"x", {3, 5}}}}});
  auto soft = tt::apply([](const at::Tensor& x) { return at::softmax(x, -1); }, a);
  expect_same(soft, native([](auto& x) { return at::softmax(x, -1); }, a));
  auto two = tt::apply([](const at::Tensor& x, const at::Tensor& y) { return x * y + 1; }, a, 3);
  expect_same(two, native([](auto& x) { return x * 3 + 1; }, a));
  auto [v, i] = tt::apply([](const at::Tensor& x) { return at::max(x, 1); }, a);
  expect_same(v, native([](auto& x) { return std::get<0>(at::max(x, 1)); }, a));
  expect_same(i, native([](auto& x) { return std::get<1>(at::max(x, 1)); }, a));
  TreeTensor c = a.clone();
  tt::apply_([](const at::Tensor& x) { x.mul_(2); }, c);
  expect_same(c, native([](auto& x) { return x * 2; }, a));
}

TEST(TensorApply, ZipModesOnRequest) {
  TreeTensor a{{"a", at::ones(2)}, {"b", at::ones(2)}};
  TreeTensor b{{"b", at::ones(2)}, {"c", at::ones(2)}};
  auto plus = [](const at::Tensor& x, const at::Tensor& y) { return x + y; };
  TreeTensor inner = tt::apply(tt::ZipOptions{tt::ZipMode::inner}, nullptr, plus, a, b);
  EXPECT_EQ(paths(inner), (std::vector<std::string>{"b"}));
  const at::Tensor zero = at::zeros(2);
  TreeTensor outer = tt::apply(tt::ZipOptions{tt::ZipMode::outer}, &zero, plus, a, b);
  EXPECT_EQ(paths(outer), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(at::equal(outer.at("b").leaf(), at::full({2}, 2.0)));
  EXPECT_TRUE(at::equal(outer.at("c").leaf(), at::ones(2)));
  EXPECT_THROW(tt::apply(tt::ZipOptions{tt::ZipMode::outer}, nullptr, plus, a, b),
               tt::tree::StructureError);
  TreeTensor leafy{{"a", at::ones(2)}, {"b", at::full({2}, 5.0)}};
  TreeTensor deep{{"a", at::ones(2)}, {"b", TensorTree{{"x", at::ones(2)}, {"y", at::ones(2)}}}};
  TreeTensor inherited =
      tt::apply(tt::ZipOptions{tt::ZipMode::strict, true}, nullptr, plus, leafy, deep);
  EXPECT_TRUE(at::equal(inherited.at("b.y").leaf(), at::full({2}, 6.0)));
}

TEST(TensorAttributes, TreesOfValuesAndSingle) {
  TreeTensor t{{"a", at::ones({2, 3})}, {"b", TensorTree{{"x", at::ones({4}, at::kDouble)}}}};
  EXPECT_EQ(t.shape().at("a").leaf(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t.numel().at("b.x").leaf(), 4);
  EXPECT_EQ(tt::single(t.device()), at::Device(at::kCPU));
  EXPECT_FALSE(tt::single(t.requires_grad()));
  try {
    tt::single(t.dtype());
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "single: leaves disagree: 1 of 2 leaves hold Float; 'b.x' holds Double");
  }
  EXPECT_THROW(tt::single(TreeTensor().dtype()), std::invalid_argument);
}

// Shapes print as torch.Size, a 0-d leaf as torch.Size([]) (c10's vector form printed nothing
// there), in the tree layout.
TEST(TensorAttributes, ShapesPrintAsTorchSize) {
  TreeTensor t{{"a", at::ones({2, 3})}, {"b", TensorTree{{"s", at::ones({})}}}};
  std::ostringstream os;
  os << t.shape();
  EXPECT_EQ(os.str(),
            "<Tree>\n"
            "├── a --> torch.Size([2, 3])\n"
            "└── b --> <Tree>\n"
            "    └── s --> torch.Size([])");
  std::ostringstream one;
  one << tt::Size{4};
  EXPECT_EQ(one.str(), "torch.Size([4])");
  EXPECT_EQ(t.shape().at("b.s").leaf(), std::vector<int64_t>{});
}

// a["b"] is a TreeTensor (the tensor API applies) sharing a's tensors.
TEST(TensorIndexing, SubtreeIsATreeTensorSharingTheLeaves) {
  TreeTensor t{{"a", at::ones({2})}, {"m", TensorTree{{"w", at::ones({3})}, {"b", at::ones({1})}}}};
  TreeTensor m = t["m"];
  EXPECT_EQ(tt::sum(m).item<float>(), 4.0f);
  EXPECT_EQ(t["m"].sum().item<float>(), 4.0f);
  EXPECT_TRUE(t["m"]["w"].leaf().is_same(t.at("m.w").leaf()));
  t["m"].mul_(2);  // in place on the shared tensors
  EXPECT_TRUE(at::equal(t.at("m.w").leaf(), at::full({3}, 2.0f)));
  const at::Tensor& w = t["m"]["w"].leaf();  // a handle by value: outlives the copy
  EXPECT_TRUE(w.is_same(t.at("m.w").leaf()));
  try {
    (void)t["m"]["nope"];
    FAIL();
  } catch (const tt::tree::KeyError& e) {
    EXPECT_TRUE(contains(e.what(), "m.nope")) << e.what();  // the whole chain is named
  }
  t.at("a") = at::zeros({2});  // replacing a node goes through at()
  EXPECT_EQ(tt::sum(t).item<float>(), 8.0f);
}

// When leaf 0 is the odd one, the message names it, not a correct leaf; values are shown.
TEST(TensorAttributes, SingleNamesTheLeavesThatDifferFromTheMajority) {
  const tt::tree::Tree<int64_t> sizes = {{"a", 3}, {"b", 4}, {"c", {{"x", 4}, {"y", 4}}}};
  try {
    tt::single(sizes);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "single: leaves disagree: 3 of 4 leaves hold 4; 'a' holds 3");
  }
  TreeTensor t{{"a", at::ones({2, 3})}, {"b", at::ones({2, 3})}, {"c", at::ones({5})}};
  try {
    tt::single(t.shape());
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "single: leaves disagree: 2 of 3 leaves hold [2, 3]; 'c' holds [5]");
  }
  tt::tree::Tree<int64_t> many;
  for (int i = 0; i < 12; ++i) many.insert("k" + std::to_string(10 + i), int64_t(i < 2 ? 7 : i));
  try {
    tt::single(many);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "single: leaves disagree: 3 of 12 leaves hold 7; 'k12' holds 2, 'k13' holds 3, "
              "'k14' holds 4, 'k15' holds 5, 'k16' holds 6, 'k18' holds 8, 'k19' holds 9, "
              "'k20' holds 10, and 1 more");
  }
}

TEST(TensorAttributes, BatchSizeIsTheSharedLeadingDimension) {
  TreeTensor t{{"obs", at::zeros({8, 3})}, {"act", TensorTree{{"id", at::zeros({8})}}}};
  EXPECT_EQ(tt::batch_size(t), 8);
  EXPECT_EQ(t.batch_size(), 8);
  auto message = [](const TreeTensor& x) {
    try {
      tt::batch_size(x);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message(TreeTensor{{"a", at::zeros({8, 3})}, {"r", at::scalar_tensor(1.0)}}),
            "batch_size: leaf 'r' is 0-d (a scalar); it has no leading dimension");
  EXPECT_EQ(
      message(TreeTensor{{"a", at::zeros({4})}, {"b", at::zeros({8})}, {"c", at::zeros({8, 2})}}),
      "batch_size: leaves disagree on dim 0: 2 of 3 leaves hold 8; 'a' holds 4");
  EXPECT_EQ(message(TreeTensor()), "batch_size: the tree has no leaves");
}

TEST(TensorIndexing, SameIndexAndTreeOfIndices) {
  at::manual_seed(3);
  TreeTensor t = randn_tree({{"a", {3, 4}}, {"b", {{"x", {5, 2}}}}});
  expect_same(t.index({Slice(), 0}), native([](auto& x) { return x.index({Slice(), 0}); }, t));
  expect_same(tt::index(t, {Slice(1, 3)}),
              native([](auto& x) { return x.index({Slice(1, 3)}); }, t));
  TreeTensor idx{{"a", at::tensor({2, 0}, at::kLong)},
                 {"b", TensorTree{{"x", at::tensor({4}, at::kLong)}}}};
  expect_same(t.index(idx), native([](auto& x, auto& i) { return x.index({i}); }, t, idx));
  TreeTensor mask = t > 0;
  expect_same(t.index(mask), native([](auto& x, auto& m) { return x.index({m}); }, t, mask));
  expect_same(t.index_select(0, at::arange(2)),
              native([](auto& x) { return x.index_select(0, at::arange(2)); }, t));
}

TEST(TensorErrors, DtypeMismatchInALeafNamesPathAndOp) {
  TreeTensor a{{"f", at::ones({2})}, {"i", at::ones({2}, at::kLong)}};
  try {
    (void)tt::bitwise_and(a, 1);  // bitwise ops are undefined for float leaves
    FAIL();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_TRUE(contains(msg, "bitwise_and at leaf 'f'")) << msg;
    EXPECT_FALSE(contains(msg, "leaf 'i'")) << msg;
  }
  TreeTensor ints{{"i", at::ones({2}, at::kLong)}};
  try {
    (void)tt::mean(ints);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_EQ(
        std::string(e.what_without_backtrace()),
        "mean: needs floating or complex leaves; all are integral or bool (leaf 'i' is Long)");
  }
  // int64 beside float32 leaves: torch.cat promotes them to float32, whose mean torch takes.
  TreeTensor mixed{{"f", at::full({2}, 0.5f)}, {"i", at::arange(4)}};
  {
    const at::Tensor all = at::cat({at::full({2}, 0.5f), at::arange(4)});
    EXPECT_EQ(tt::mean(mixed).scalar_type(), at::kFloat);
    EXPECT_TRUE(at::allclose(tt::mean(mixed), all.mean(), 0, 1e-6));
    EXPECT_TRUE(at::allclose(tt::std(mixed), all.std(), 0, 1e-6));
  }
}

// Mixed devices (issue 3): runs where LibTorch has CUDA and a GPU; skipped elsewhere.
TEST(TensorDevices, MixedCpuAndCudaLeaves) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(0);
  TreeTensor t{{"c", at::randn({3, 3})}, {"g", at::randn({3, 3}, at::Device(at::kCUDA))}};
  TreeTensor u = tt::tree::map([](const at::Tensor& x) { return at::randn_like(x); }, t);
  expect_same(t * u + 1, native([](auto& x, auto& y) { return x * y + 1; }, t, u));
  expect_matmul_agrees(tt::matmul(t, u),
                       native([](auto& x, auto& y) { return at::matmul(x, y); }, t, u), t, u);
  EXPECT_THROW(tt::single(t.device()), std::invalid_argument);
  TreeTensor on_gpu = t.to(at::Device(at::kCUDA));
  EXPECT_EQ(tt::single(on_gpu.device()).type(), at::kCUDA);
  EXPECT_TRUE(on_gpu.at("g").leaf().is_same(t.at("g").leaf())) << "already there: no copy";
  TreeTensor r = tt::randn({{"a", {4}}}, at::TensorOptions().device(at::kCUDA));
  EXPECT_EQ(r.at("a").leaf().device().type(), at::kCUDA);
  EXPECT_TRUE(tt::sum(tt::cpu(on_gpu)).equal(tt::sum(t.cpu()))) << "copies sum alike";
}
