// Random tree programs (DESIGN.md §5): random structures up to a few hundred leaves, random
// sequences of leaf-wise ops, in-place ops and reductions. Under every execution strategy the
// results equal, bitwise, the same program written as a loop over the leaves with at:: calls.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "tensor_test_util.hpp"
#include "treetensor/tensor/tensor.hpp"

namespace tt = treetensor;
using namespace tt_test;
using tt::TreeTensor;

namespace {

class TensorPrograms : public ::testing::TestWithParam<rt::StreamMode> {
 protected:
  static void SetUpTestSuite() { at::manual_seed(0); }
  rt::StreamGuard guard_{GetParam()};
};

constexpr int kOps = 13;

// The native side: the program's state as plain leaf vectors.
struct Native {
  std::vector<at::Tensor> x, y;
  std::vector<at::Tensor> scalars;  // tree-level reduction results, in program order

  at::Tensor stacked_sum(const std::vector<at::Tensor>& l) const {
    std::vector<at::Tensor> parts;
    for (const auto& t : l) parts.push_back(t.sum());
    return at::stack(parts).sum();
  }

  void step(int op) {
    const std::size_t n = x.size();
    for (std::size_t k = 0; k < n; ++k) {
      at::Tensor &a = x[k], &b = y[k];
      switch (op) {
        case 0:
          a = a + b;
          break;
        case 1:
          a = a * 0.5;
          break;
        case 2:
          a.mul_(at::tanh(b));
          break;
        case 3:
          a = at::sigmoid(a);
          break;
        case 4:
          a.add_(b, 0.1);
          break;
        case 5:
          b = b - a;
          break;
        case 6:
          a.addcmul_(b, b, 0.01);
          break;
        case 9:
          a = at::where(a > 0, a, b);
          break;
        case 10:
          a = at::tanh(a);
          break;
        case 11:
          a.clamp_(-1, 1);
          break;
        case 12:
          a = a / (at::abs(b) + 1);
          break;
        default:
          break;
      }
    }
    if (op == 7) scalars.push_back(stacked_sum(x));
    if (op == 8) {
      int64_t total = 0;
      for (const auto& t : y) total += t.numel();
      scalars.push_back(stacked_sum(y) / static_cast<double>(total));
    }
  }
};

// The tree side: the same program with tree ops.
struct Tree {
  TreeTensor x, y;
  std::vector<at::Tensor> scalars;

  void step(int op) {
    switch (op) {
      case 0:
        x = x + y;
        break;
      case 1:
        x = x * 0.5;
        break;
      case 2:
        x *= tt::tanh(y);
        break;
      case 3:
        x = tt::sigmoid(x);
        break;
      case 4:
        tt::add_(x, y, 0.1);
        break;
      case 5:
        y = y - x;
        break;
      case 6:
        tt::addcmul_(x, y, y, 0.01);
        break;
      case 7:
        scalars.push_back(tt::sum(x));
        break;
      case 8:
        scalars.push_back(tt::mean(y));
        break;
      case 9:
        x = tt::where(x > 0, x, y);
        break;
      case 10:
        x = x.tanh();
        break;
      case 11:
        x.clamp_(-1, 1);
        break;
      case 12:
        x = x / (tt::abs(y) + 1);
        break;
      default:
        break;
    }
  }
};

}  // namespace

TEST_P(TensorPrograms, RandomProgramsEqualTheNativeLoopBitwise) {
  std::mt19937 rng(1234);  // the same programs for every strategy
  for (int program = 0; program < 8; ++program) {
    SCOPED_TRACE("program " + std::to_string(program));
    const tt::ShapeTree shapes = random_shapes(rng, 300);
    at::manual_seed(program);
    Tree tree{randn_tree(shapes), randn_tree(shapes), {}};
    Native ref{leaves(tree.x.clone()), leaves(tree.y.clone()), {}};
    std::uniform_int_distribution<int> pick(0, kOps - 1);
    for (int s = 0; s < 16; ++s) {
      const int op = pick(rng);
      tree.step(op);
      ref.step(op);
    }
    const auto spec = tt::tree::flatten(tree.x).spec;
    expect_same(tree.x, tt::tree::unflatten(spec, ref.x));
    expect_same(tree.y, tt::tree::unflatten(spec, ref.y));
    ASSERT_EQ(tree.scalars.size(), ref.scalars.size());
    for (std::size_t k = 0; k < ref.scalars.size(); ++k)
      EXPECT_TRUE(at::allclose(tree.scalars[k], ref.scalars[k], 0, 0, true))
          << tree.scalars[k] << " vs " << ref.scalars[k];
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, TensorPrograms, ::testing::ValuesIn(strategies()),
                         strategy_name);

// Tied weights: one tensor at two paths, and leaves updated from each other's tensors. The
// native loop updates them one after another in flatten order; every strategy must agree.
TEST_P(TensorPrograms, AliasedLeavesUpdateInFlattenOrder) {
  for (int round = 0; round < 20; ++round) {
    const at::Tensor t1 = at::randn({64}), t2 = at::randn({64}), t3 = at::randn({64});
    const at::Tensor n1 = t1.clone(), n2 = t2.clone(), n3 = t3.clone();
    TreeTensor a{{"x", t1}, {"y", t2}, {"z", t1}, {"w", t3}};
    TreeTensor b{{"x", t2}, {"y", t1}, {"z", t3}, {"w", t3}};
    a.add_(b, 0.5);  // flatten order: w, x, y, z
    n3.add_(n3, 0.5);
    n1.add_(n2, 0.5);
    n2.add_(n1, 0.5);
    n1.add_(n3, 0.5);
    EXPECT_TRUE(at::equal(t1, n1));
    EXPECT_TRUE(at::equal(t2, n2));
    EXPECT_TRUE(at::equal(t3, n3));
    // Disjoint views of one storage are independent leaves and still give the loop's values.
    const at::Tensor base = at::randn({8, 16}), nbase = base.clone();
    TreeTensor parts = tt::tree::unflatten(
        tt::tree::flatten(TreeTensor{{"p", at::Tensor()}, {"q", at::Tensor()}}).spec,
        base.chunk(2, 0));
    tt::mul_(parts, 3.0);
    EXPECT_TRUE(at::equal(base, nbase * 3.0));
  }
}
