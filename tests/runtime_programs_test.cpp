// Random leaf programs give the same values under every execution mode as the native loop, and
// every leaf job runs exactly once (DESIGN.md §5; issue 4 "the proof").
//
// Each program is a random number of leaves (1..300) of random small shapes, then a random
// sequence of steps — out-of-place add, in-place scale, matmul, per-leaf sums reduced in leaf
// order — run through runtime::run under one mode. Every step is checked against the plain
// loop over torch:: applied to the same inputs (the state before the step): elementwise steps
// and sums bitwise, matmuls within the rounding bound of treetensor/tensor/rounding.hpp (a lane
// runs BLAS with one thread, and the fused form is one bmm: another summation order).
#include "runtime_test_util.hpp"
#include "treetensor/runtime/stream.hpp"
#include "treetensor/tensor/rounding.hpp"

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

// The native loop's step on `x` (the reference for one step); sums go to `total`.
std::vector<at::Tensor> native_step(Op op, std::vector<at::Tensor> x, const Program& p,
                                    double& total) {
  total = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    switch (op) {
      case Op::add:
        x[i] = x[i] + p.y[i];
        break;
      case Op::scale_:
        x[i] = x[i].mul(0.5);
        break;
      case Op::matmul:
        x[i] = at::matmul(x[i], p.w[i]);
        break;
      case Op::sum:
        total += x[i].sum().item<double>();
        break;
    }
  }
  return x;
}

// The step's results against the native step from the same inputs `before`.
void expect_step_agrees(Op op, const std::vector<at::Tensor>& before,
                        const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want,
                        const Program& p, int prog) {
  namespace rd = treetensor::rounding;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const rd::Agreement a = op == Op::matmul
                                ? rd::compare_matmul(got[i], want[i], before[i], p.w[i])
                                : rd::compare_bitwise(got[i], want[i]);
    ASSERT_TRUE(a.holds()) << "program " << prog << ", " << name(op) << ", leaf " << i << ": "
                           << a.describe();
  }
}

class Programs : public ::testing::TestWithParam<rt::StreamMode> {};

}  // namespace

TEST_P(Programs, SameValuesAsNativeLoopAndEveryLeafOnce) {
  const rt::StreamMode mode = GetParam();
  std::mt19937 gen(12345);
  at::manual_seed(7);
  const int programs = rt_test::under_tsan ? 4 : 12;
  rt_test::with_watchdog(60s, [&] {
    for (int prog = 0; prog < programs; ++prog) {
      const Program p = random_program(gen);
      std::vector<at::Tensor> x;
      for (const auto& t : p.x) x.push_back(t.clone());
      rt::StreamGuard guard(mode);
      for (Op op : p.steps) {
        std::vector<at::Tensor> before;
        for (const auto& t : x) before.push_back(t.clone());  // scale_ writes x in place
        double expected_total = 0;
        const std::vector<at::Tensor> want = native_step(op, before, p, expected_total);
        std::vector<at::Tensor> sums(x.size());
        std::vector<std::atomic<int>> runs(x.size());
        int fused_runs = 0;
        step(op, x, p, sums, runs, fused_runs);
        for (std::size_t i = 0; i < x.size(); ++i)
          ASSERT_EQ(runs[i].load() + fused_runs, 1) << name(op) << " leaf " << i;
        if (op == Op::sum) {
          double total = 0;
          for (const auto& s : sums) total += s.item<double>();  // leaf order, as native
          EXPECT_EQ(total, expected_total) << "program " << prog;
        }
        expect_step_agrees(op, before, x, want, p, prog);
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
