// Random leaf programs give the same values under every execution mode as the native loop, and
// every leaf job runs exactly once (DESIGN.md §5; issue 4 "the proof").
//
// Each program is a random number of leaves (1..300) of random small shapes, then a random
// sequence of steps — out-of-place add, in-place scale, matmul, per-leaf sums reduced in leaf
// order — run through runtime::run under one mode, and once as a plain loop over torch::.
// Per-leaf strategies must match bitwise; fused forms (_foreach_*, bmm) and automatic (which
// may pick them) within float tolerance, since bmm may sum in another order.
#include "runtime_test_util.hpp"
#include "treetensor/runtime/stream.hpp"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <vector>

namespace rt = treetensor::runtime;
using namespace std::chrono_literals;

namespace {

enum class Op { add, scale_, matmul, sum };

struct Program {
  std::vector<at::Tensor> x, y, w;  // per leaf: x r×c, y r×c, w c×c
  std::vector<Op> steps;
};

Program random_program(std::mt19937& gen) {
  Program p;
  const std::size_t leaves = std::uniform_int_distribution<std::size_t>(1, 300)(gen);
  const bool same_shape = gen() % 2 == 0;  // lets bmm apply
  for (std::size_t i = 0; i < leaves; ++i) {
    const int64_t r = same_shape ? 4 : 1 + gen() % 6, c = same_shape ? 5 : 1 + gen() % 6;
    p.x.push_back(at::randn({r, c}));
    p.y.push_back(at::randn({r, c}));
    p.w.push_back(at::randn({c, c}) / 4);
  }
  const std::size_t steps = 3 + gen() % 6;
  for (std::size_t s = 0; s < steps; ++s) p.steps.push_back(static_cast<Op>(gen() % 4));
  return p;
}

const char* name(Op op) {
  switch (op) {
    case Op::add:
      return "add";
    case Op::scale_:
      return "mul_";
    case Op::matmul:
      return "matmul";
    case Op::sum:
      return "sum";
  }
  return "?";
}

// Runs one step on every leaf as the runtime would, with a fused form where one exists.
void step(Op op, std::vector<at::Tensor>& x, const Program& p, std::vector<at::Tensor>& sums,
          std::vector<std::atomic<int>>& runs, int& fused_runs) {
  const std::size_t n = x.size();
  auto leaf = [&](std::size_t i) {
    runs[i].fetch_add(1, std::memory_order_relaxed);
    switch (op) {
      case Op::add:
        x[i] = x[i] + p.y[i];
        break;
      case Op::scale_:
        x[i].mul_(0.5);
        break;
      case Op::matmul:
        x[i] = at::matmul(x[i], p.w[i]);
        break;
      case Op::sum:
        sums[i] = x[i].sum();
        break;
    }
  };
  auto fused = [&]() -> bool {
    switch (op) {
      case Op::add:
        x = at::_foreach_add(x, p.y);
        break;
      case Op::scale_:
        at::_foreach_mul_(x, 0.5);
        break;
      case Op::matmul: {
        for (std::size_t i = 1; i < n; ++i)
          if (!x[i].sizes().equals(x[0].sizes()) || !p.w[i].sizes().equals(p.w[0].sizes()))
            return false;  // declines: shapes differ
        auto parts = at::bmm(at::stack(x), at::stack(p.w)).unbind(0);
        for (std::size_t i = 0; i < n; ++i) x[i] = parts[i];
        break;
      }
      case Op::sum:
        return false;
    }
    ++fused_runs;
    return true;
  };
  auto label = [](std::size_t i) { return rt_test::leaf_label(i); };
  auto cost = [&](std::size_t i) {
    const double e = static_cast<double>(x[i].numel());
    return rt::LeafCost{op == Op::matmul ? 2 * e * static_cast<double>(x[i].size(1)) : e, 12 * e};
  };
  rt::LeafCall call;
  call.op = name(op);
  call.leaves = n;
  call.run = leaf;
  call.label = label;
  call.cost = cost;
  call.fused = fused;
  rt::run(call);
}

// The native loop: the reference.
std::vector<at::Tensor> native(const Program& p, std::vector<double>& totals) {
  std::vector<at::Tensor> x;
  for (const auto& t : p.x) x.push_back(t.clone());
  for (Op op : p.steps) {
    double total = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      switch (op) {
        case Op::add:
          x[i] = x[i] + p.y[i];
          break;
        case Op::scale_:
          x[i].mul_(0.5);
          break;
        case Op::matmul:
          x[i] = at::matmul(x[i], p.w[i]);
          break;
        case Op::sum:
          total += x[i].sum().item<double>();
          break;
      }
    }
    if (op == Op::sum) totals.push_back(total);
  }
  return x;
}

class Programs : public ::testing::TestWithParam<rt::StreamMode> {};

}  // namespace

TEST_P(Programs, SameValuesAsNativeLoopAndEveryLeafOnce) {
  const rt::StreamMode mode = GetParam();
  const bool exact = mode.kind == rt::StreamMode::Kind::lanes;
  std::mt19937 gen(12345);
  at::manual_seed(7);
  const int programs = rt_test::under_tsan ? 4 : 12;
  rt_test::with_watchdog(60s, [&] {
    for (int prog = 0; prog < programs; ++prog) {
      const Program p = random_program(gen);
      std::vector<double> expected_totals, totals;
      const std::vector<at::Tensor> expected = native(p, expected_totals);
      std::vector<at::Tensor> x;
      for (const auto& t : p.x) x.push_back(t.clone());
      rt::StreamGuard guard(mode);
      for (Op op : p.steps) {
        std::vector<at::Tensor> sums(x.size());
        std::vector<std::atomic<int>> runs(x.size());
        int fused_runs = 0;
        step(op, x, p, sums, runs, fused_runs);
        for (std::size_t i = 0; i < x.size(); ++i)
          ASSERT_EQ(runs[i].load() + fused_runs, 1) << name(op) << " leaf " << i;
        if (op == Op::sum) {
          double total = 0;
          for (const auto& s : sums) total += s.item<double>();  // leaf order
          totals.push_back(total);
        }
      }
      ASSERT_EQ(totals.size(), expected_totals.size());
      for (std::size_t k = 0; k < totals.size(); ++k) {
        if (exact)
          EXPECT_EQ(totals[k], expected_totals[k]) << "program " << prog;
        else
          EXPECT_NEAR(totals[k], expected_totals[k], 1e-3 * (1 + std::abs(expected_totals[k])));
      }
      for (std::size_t i = 0; i < x.size(); ++i) {
        if (exact)
          ASSERT_TRUE(at::equal(x[i], expected[i])) << "program " << prog << " leaf " << i;
        else
          ASSERT_TRUE(at::allclose(x[i], expected[i], 1e-4, 1e-5))
              << "program " << prog << " leaf " << i;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Modes, Programs,
                         ::testing::Values(rt::StreamMode::of(1), rt::StreamMode::of(2),
                                           rt::StreamMode::of(4), rt::StreamMode::of(8),
                                           rt::StreamMode::of(rt::automatic),
                                           rt::StreamMode::of(rt::fused)),
                         [](const auto& info) {
                           const rt::StreamMode& m = info.param;
                           switch (m.kind) {
                             case rt::StreamMode::Kind::lanes:
                               return "lanes" + std::to_string(m.lanes);
                             case rt::StreamMode::Kind::automatic:
                               return std::string("automatic");
                             case rt::StreamMode::Kind::fused:
                               return std::string("fused");
                           }
                           return std::string("unknown");
                         });
