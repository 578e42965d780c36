// Execution policy: explain(), stream(fused), the automatic learner, identical values under
// every strategy (DESIGN.md §5, §8, §9).
#include "runtime/policy.hpp"
#include "runtime_test_util.hpp"
#include "treetensor/runtime/stream.hpp"
#include "treetensor/tensor/rounding.hpp"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace rt = treetensor::runtime;
using namespace std::chrono_literals;
using rt_test::with_watchdog;

namespace {

// A call over `n` leaves whose leaf job and fused form are caller-supplied lambdas.
struct Call {
  std::function<void(std::size_t)> leaf;
  std::function<bool()> fused_fn;
  std::function<rt::LeafCost(std::size_t)> cost_fn;
  rt::LeafCall call;

  Call(std::string_view op, std::size_t n) {
    call.op = op;
    call.leaves = n;
    call.run = run_leaf;
    call.label = label;
  }
  void with_fused(std::function<bool()> f) {
    fused_fn = std::move(f);
    call.fused = fused_ref;
  }
  void with_cost(std::function<rt::LeafCost(std::size_t)> f) {
    cost_fn = std::move(f);
    call.cost = cost_ref;
  }

 private:
  std::function<void(std::size_t)> run_leaf = [this](std::size_t i) { leaf(i); };
  std::function<std::string(std::size_t)> label = [](std::size_t i) {
    return rt_test::leaf_label(i);
  };
  std::function<bool()> fused_ref = [this] { return fused_fn(); };
  std::function<rt::LeafCost(std::size_t)> cost_ref = [this](std::size_t i) { return cost_fn(i); };
};

}  // namespace

TEST(Policy, ExplainFollowsTheMode) {
  Call c("probe", 10);
  c.leaf = [](std::size_t) {};
  EXPECT_EQ(rt::explain(c.call).strategy, rt::Strategy::linear);
  {
    rt::StreamGuard g(4);
    const rt::Decision d = rt::explain(c.call);
    EXPECT_EQ(d.strategy, rt::Strategy::lanes);
    EXPECT_EQ(d.lanes, 4u);
    EXPECT_EQ(d.reason, "stream(4)");
  }
  {
    rt::StreamGuard g(8);
    c.call.leaves = 3;
    EXPECT_EQ(rt::explain(c.call).lanes, 3u) << "never more lanes than leaves";
    c.call.leaves = 1;
    EXPECT_EQ(rt::explain(c.call).strategy, rt::Strategy::linear);
  }
  {
    rt::StreamGuard g(rt::fused);
    EXPECT_EQ(rt::explain(c.call).strategy, rt::Strategy::linear) << "no fused form";
    c.with_fused([] { return true; });
    EXPECT_EQ(rt::explain(c.call).strategy, rt::Strategy::fused);
  }
}

TEST(Policy, FusedModeRunsTheFusedFormOrFallsBackToLeavesOnce) {
  std::vector<int> runs(12, 0);
  int fused_calls = 0;
  Call c("add", runs.size());
  c.leaf = [&](std::size_t i) { ++runs[i]; };
  rt::StreamGuard g(rt::fused);
  c.with_fused([&] {
    ++fused_calls;
    return true;
  });
  rt::run(c.call);
  EXPECT_EQ(fused_calls, 1);
  EXPECT_EQ(std::count(runs.begin(), runs.end(), 0), 12) << "leaves must not run when fused did";
  c.with_fused([&] {
    ++fused_calls;
    return false;  // declines: shapes differ
  });
  rt::run(c.call);
  EXPECT_EQ(fused_calls, 2);
  EXPECT_EQ(std::count(runs.begin(), runs.end(), 1), 12) << "every leaf exactly once";
  c.with_fused([]() -> bool { throw std::invalid_argument("stack: shapes differ"); });
  try {
    rt::run(c.call);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "add (fused): stack: shapes differ");
  }
}

TEST(Policy, AutomaticKeepsTinyCallsOnTheCaller) {
  Call c("tiny_add", 10);  // ~10 dispatches: a few µs, below any parked-worker wake-up
  const auto self = std::this_thread::get_id();
  std::atomic<int> elsewhere{0};
  c.leaf = [&](std::size_t) { elsewhere += std::this_thread::get_id() != self; };
  c.with_cost([](std::size_t) { return rt::LeafCost{4, 48}; });  // 4 floats: add
  rt::StreamGuard g(rt::automatic);
  const rt::Decision d = rt::explain(c.call);
  EXPECT_EQ(d.strategy, rt::Strategy::linear);
#if !defined(__SANITIZE_ADDRESS__)
  // Under ASan the calibrated dispatch and hand-off costs shift unevenly, so the call may be
  // kept on the caller as "measuring linear first" rather than as tiny; both stay linear.
  EXPECT_NE(d.reason.find("tiny"), std::string::npos) << d.reason;
#endif
  for (int rep = 0; rep < 20; ++rep) rt::run(c.call);
  EXPECT_EQ(elsewhere.load(), 0);
  const auto& cal = rt::detail::calibration();
  EXPECT_GT(cal.handoff_s, 0);
  EXPECT_GT(cal.dispatch_s, 0);
  EXPECT_GT(cal.flop_rate, 0);
  EXPECT_GT(cal.byte_rate, 0);
}

TEST(Policy, AutomaticLearnsLanesForParallelWorkAndFusedWhenItIsFaster) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "needs two hardware threads";
  with_watchdog(60s, [&] {
    rt::StreamGuard g(rt::StreamMode{rt::StreamMode::Kind::automatic, 2});
    // Leaves that wait 5 ms each overlap on two lanes whatever the machine's load (a loaded
    // scheduler adds a millisecond or two, far below the 20 ms gained, and 40 ms a call is
    // far above any hand-off, so the shape is timed); the fused form is much slower.
    Call waits("learn_sleep", 8);
    waits.leaf = [](std::size_t) { std::this_thread::sleep_for(5ms); };
    waits.with_fused([] {
      std::this_thread::sleep_for(100ms);
      return true;
    });
    for (int rep = 0; rep < 10; ++rep) rt::run(waits.call);
    rt::Decision d = rt::explain(waits.call);
    EXPECT_EQ(d.strategy, rt::Strategy::lanes) << d.reason;
    EXPECT_NE(d.reason.find("measured"), std::string::npos) << d.reason;

    Call batched("learn_fused", 8);
    batched.leaf = [](std::size_t) { std::this_thread::sleep_for(5ms); };
    batched.with_fused([] {
      std::this_thread::sleep_for(1ms);
      return true;
    });
    for (int rep = 0; rep < 10; ++rep) rt::run(batched.call);
    d = rt::explain(batched.call);
    EXPECT_EQ(d.strategy, rt::Strategy::fused) << d.reason;
  });
}

TEST(Policy, AutomaticRemembersAFusedFormThatDeclines) {
  Call c("declines", 16);
  std::vector<int> runs(16, 0);
  c.leaf = [&](std::size_t i) {
    ++runs[i];
    std::this_thread::sleep_for(2ms);  // 32 ms a call: far above any hand-off, so it is timed
  };
  int fused_calls = 0;
  c.with_fused([&] {
    ++fused_calls;
    return false;
  });
  rt::StreamGuard g(rt::automatic);
  for (int rep = 0; rep < 10; ++rep) rt::run(c.call);
  EXPECT_EQ(fused_calls, 1) << "asked once, then remembered";
  for (int n : runs) EXPECT_EQ(n, 10);
}

TEST(Policy, ValuesAreTheSameUnderEveryStrategy) {
  at::manual_seed(1);
  constexpr std::size_t n = 40;
  std::vector<at::Tensor> a, b, expected, got(n);
  for (std::size_t i = 0; i < n; ++i) {
    a.push_back(at::randn({8, 16}));
    b.push_back(at::randn({16, 32}));
    expected.push_back(at::matmul(a[i], b[i]));
  }
  Call c("matmul", n);
  c.leaf = [&](std::size_t i) { got[i] = at::matmul(a[i], b[i]); };
  c.with_cost([](std::size_t) { return rt::LeafCost{2.0 * 8 * 16 * 32, 4.0 * (128 + 512 + 256)}; });
  c.with_fused([&] {
    auto parts = at::bmm(at::stack(a), at::stack(b)).unbind(0);
    for (std::size_t i = 0; i < n; ++i) got[i] = parts[i];
    return true;
  });
  const std::vector<rt::StreamMode> modes{rt::StreamMode::of(1),
                                          rt::StreamMode::of(2),
                                          rt::StreamMode::of(4),
                                          rt::StreamMode::of(8),
                                          rt::StreamMode::of(rt::automatic),
                                          rt::StreamMode::of(rt::fused)};
  with_watchdog(30s, [&] {
    for (const auto& mode : modes) {
      rt::StreamGuard g(mode);
      for (int rep = 0; rep < 8; ++rep) {  // automatic explores several strategies
        std::fill(got.begin(), got.end(), at::Tensor());
        rt::run(c.call);
        for (std::size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(got[i].defined()) << mode.to_string() << " leaf " << i;
          // A lane runs BLAS with one thread and the fused form is one bmm: both may sum in
          // another order than the caller's mm (DESIGN.md §5), so the matmul rounding bound.
          const auto agreement =
              treetensor::rounding::compare_matmul(got[i], expected[i], a[i], b[i]);
          ASSERT_TRUE(agreement.holds())
              << mode.to_string() << " leaf " << i << ": " << agreement.describe();
        }
      }
    }
  });
}

TEST(Policy, LogPolicyPrintsOneLinePerAutomaticDecision) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("TREETENSOR_LOG_POLICY", "1", 1);
        Call c("logged_op", 3);
        c.leaf = [](std::size_t) {};
        rt::StreamGuard g(rt::automatic);
        rt::run(c.call);
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "treetensor policy: logged_op leaves=3 -> linear\\(1\\): ");
}

// DESIGN.md §10, "fork()": the one-time calibration takes milliseconds; a child forked while
// another thread runs it must calibrate itself, not wait for a thread it does not have (a
// function-local static's guard made it wait for ever). ctest runs each case in a fresh
// process, so the calibration starts here; the fork lands in it when it takes over 1 ms.
TEST(PolicyFork, AChildForkedWhileAnotherThreadCalibratesCalibratesItself) {
  if (rt_test::under_tsan) GTEST_SKIP() << "ThreadSanitizer ends children that start threads";
  // A child forked while the other thread allocates inherits AddressSanitizer's allocator lock
  // held: its first lane worker then hangs in ASan's own thread start (AsanThread::Init ->
  // calloc), before any of our code runs (1 run in about 45 under load here).
  if (rt_test::under_asan) GTEST_SKIP() << "AddressSanitizer's allocator lock is not fork-safe";
  const auto t0 = std::chrono::steady_clock::now();
  std::thread calibrating([] { (void)rt::detail::calibration(); });
  std::this_thread::sleep_for(1ms);
  const auto forked_after = std::chrono::steady_clock::now() - t0;
  const int status =
      rt_test::in_forked_child(30s, [] { return rt::detail::calibration().took_s > 0 ? 0 : 1; });
  calibrating.join();
  EXPECT_EQ(status, 0) << "-1: the child hung";
  const double took_ms = rt::detail::calibration().took_s * 1e3;
  if (took_ms < std::chrono::duration<double, std::milli>(forked_after).count())
    GTEST_SKIP() << "the calibration (" << took_ms << " ms) ended before the fork";
}
