// consolidate(): one buffer per (dtype, device) group, flatten order, 64-byte aligned leaves
// (DESIGN.md §12); is_consolidated() notices a replaced leaf or a changed structure.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <utility>

#include "tensor_test_util.hpp"
#include "treetensor/tensor/tensor.hpp"

namespace tt = treetensor;
using namespace tt_test;

TEST(Consolidate, OneAlignedBufferPerGroupInFlattenOrder) {
  at::manual_seed(2);
  const TreeTensor t{
      {"a", at::randn({3})},
      {"b", TensorTree{{"x", at::randn({2, 5}, at::kDouble)}, {"y", at::randn({0})}}},
      {"c", at::scalar_tensor(4.0, at::kDouble)},
      {"i", at::arange(7)}};
  EXPECT_FALSE(tt::is_consolidated(t));
  const TreeTensor c = tt::consolidate(t);
  ASSERT_TRUE(tt::is_consolidated(c));
  expect_same(c, t);  // same values, dtypes, shapes
  const auto groups = tt::consolidated_groups(c);
  ASSERT_EQ(groups.size(), 3u);  // float (a, b.y), double (b.x, c), long (i)
  EXPECT_EQ(groups[0].buffer.scalar_type(), at::kFloat);
  EXPECT_EQ(groups[0].ranges, (std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {16, 0}}));
  EXPECT_EQ(groups[1].ranges, (std::vector<std::pair<int64_t, int64_t>>{{0, 10}, {16, 1}}));
  for (const auto& g : groups)
    for (const auto& [offset, n] : g.ranges)
      EXPECT_EQ(offset * g.buffer.element_size() % tt::kConsolidateAlignment, 0);
  EXPECT_TRUE(c.at("a").leaf().storage().is_alias_of(c.at("b.y").leaf().storage()));
  // Consolidating again is free: the same tensors.
  const TreeTensor again = tt::consolidate(c);
  EXPECT_TRUE(again.at("b.x").leaf().is_same(c.at("b.x").leaf()));
}

TEST(Consolidate, WritesThroughViewsReachTheBufferAndReplacingALeafIsNoticed) {
  TreeTensor c = tt::consolidate(TreeTensor{{"a", at::zeros({4})}, {"b", at::zeros({2, 2})}});
  std::as_const(c).at("b").leaf()[1].fill_(3);
  const auto groups = tt::consolidated_groups(c);
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_TRUE(groups[0].buffer.narrow(0, 16, 4).equal(at::tensor({0.0f, 0.0f, 3.0f, 3.0f})));
  c += 1;  // in-place tree ops keep the leaves, so the tree stays consolidated
  EXPECT_TRUE(tt::is_consolidated(c));
  TreeTensor replaced = c;
  replaced.at("a").leaf() = at::ones({4});
  EXPECT_FALSE(tt::is_consolidated(replaced));
  expect_same(replaced, TreeTensor{{"a", at::ones({4})}, {"b", std::as_const(c).at("b").leaf()}});
  TreeTensor grown = c;
  grown.insert("z", TensorTree(at::ones({1})));
  EXPECT_FALSE(tt::is_consolidated(grown));
  EXPECT_TRUE(tt::is_consolidated(c + 1)) << "a result of a flat call is consolidated";
}

TEST(Consolidate, AutogradLeavesStayLeaves) {
  const TreeTensor w = tt::randn({{"a", {3}}, {"b", {2}}}, at::TensorOptions().requires_grad(true));
  TreeTensor c = tt::consolidate(w);
  EXPECT_TRUE(c.at("a").leaf().requires_grad());
  EXPECT_TRUE(c.at("a").leaf().is_leaf());
  tt::sum(c * 2).backward();
  EXPECT_TRUE(c.at("b").leaf().grad().equal(at::full({2}, 2.0f)));
  EXPECT_THROW(tt::consolidate(TreeTensor{{"u", at::Tensor()}}), std::invalid_argument);
}

// A leaf reshaped, transposed, resized or pointed at other memory in place (through a reference
// a caller held: Python's t.unsqueeze_(0), t.a.t_(), t.a.data = x) has left its buffer: the
// tree is no longer consolidated, and ops give the per-leaf values, not the buffer's.
TEST(Consolidate, ALeafChangedInPlaceTakesThePropertyAway) {
  const std::vector<std::pair<const char*, void (*)(const at::Tensor&)>> changes = {
      {"unsqueeze_", [](const at::Tensor& a) { a.unsqueeze_(0); }},
      {"t_", [](const at::Tensor& a) { a.t_(); }},
      {"resize_",
       [](const at::Tensor& a) {
         a.resize_({2, 2});
       }},
      {"set_", [](const at::Tensor& a) {
         a.set_(at::ones({3, 3}));
       }}};
  for (const auto& [name, change] : changes) {
    SCOPED_TRACE(name);
    at::manual_seed(3);
    const TreeTensor c =
        tt::consolidate(TreeTensor{{"a", at::randn({3, 3})}, {"b", at::randn({4})}});
    const at::Tensor& a = c.at("a").leaf();  // makes the leaves
    ASSERT_TRUE(tt::is_consolidated(c));
    change(a);
    EXPECT_FALSE(tt::is_consolidated(c));
    expect_same(c + 1, TreeTensor{{"a", a + 1}, {"b", c.at("b").leaf() + 1}});
  }
}

// A flat in-place call on a tree consolidated in place (its leaves lay in a buffer already, so
// they keep their own version counters, as treetensor.nn's parameters do) moves every leaf's
// version: autograd then refuses a backward through a saved leaf, as after torch's in-place op.
TEST(Consolidate, AFlatInPlaceCallMovesTheVersionOfLeavesConsolidatedInPlace) {
  const TreeTensor c = tt::consolidate(TreeTensor{{"a", at::randn({4})}, {"b", at::randn({3})}});
  const TreeTensor q =
      tt::consolidate(TreeTensor{{"a", c.at("a").leaf()}, {"b", c.at("b").leaf()}});
  ASSERT_TRUE(tt::is_consolidated(q));
  const at::Tensor a = q.at("a").leaf();
  const at::Tensor x = at::ones({4}).requires_grad_();
  const at::Tensor y = (x * a).sum();  // saves a
  const auto version = a._version();
  {
    at::NoGradGuard no_grad;
    TreeTensor w = q;
    w.mul_(0.5);
  }
  EXPECT_GT(a._version(), version);
  EXPECT_THROW(y.backward(), c10::Error);
}

// to() its own dtype and device is the tree itself (torch's `to` gives self): the same leaves,
// still consolidated, not a second tree over the same buffers.
TEST(Consolidate, ToItsOwnDtypeIsTheTreeItself) {
  const TreeTensor c = tt::consolidate(TreeTensor{{"a", at::randn({4})}, {"b", at::randn({3})}});
  const at::Tensor& a = c.at("a").leaf();
  const TreeTensor same = c.to(at::kFloat);
  EXPECT_TRUE(tt::is_consolidated(same));
  EXPECT_TRUE(same.at("a").leaf().is_same(a));
}
