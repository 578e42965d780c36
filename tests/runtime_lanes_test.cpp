// Lanes: values, exactly-once, nesting, errors, thread-local state, kernel threads, idle CPU
// (DESIGN.md §5, §6; issue 4).
#include "runtime/kernel_threads.hpp"
#include "runtime/lanes.hpp"
#include "runtime_test_util.hpp"
#include "treetensor/runtime/errors.hpp"
#include "treetensor/runtime/stream.hpp"
#include "treetensor/tensor/rounding.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <time.h>

#include <atomic>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace rt = treetensor::runtime;
using namespace std::chrono_literals;
using rt_test::run_leaves;
using rt_test::with_watchdog;

namespace {

class Lanes : public ::testing::TestWithParam<std::size_t> {
 protected:
  static void SetUpTestSuite() {
    at::manual_seed(0);  // touch the default generator once, before any lane exists
  }
  std::size_t lanes() const { return GetParam(); }
};

std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  return x ^ (x >> 33);
}

}  // namespace

// A lane runs BLAS with one thread, the caller with all: the matmul rounding bound decides
// (DESIGN.md §5), bitwise where the sizes stay below the BLAS's threading threshold.
TEST_P(Lanes, MatmulValuesAgreeWithHandWrittenLoop) {
  constexpr std::size_t n = 60;
  std::vector<at::Tensor> a, b, expected, got(n);
  for (std::size_t i = 0; i < n; ++i) {
    const int64_t s = 4 + static_cast<int64_t>(i % 7) * 5;
    a.push_back(at::randn({s, 2 * s}));
    b.push_back(at::randn({2 * s, 3 * s}));
    expected.push_back(at::matmul(a.back(), b.back()));
  }
  with_watchdog(20s, [&] {
    rt::StreamGuard guard(lanes());
    run_leaves("matmul", n, [&](std::size_t i) { got[i] = at::matmul(a[i], b[i]); });
  });
  for (std::size_t i = 0; i < n; ++i) {
    const auto agreement = treetensor::rounding::compare_matmul(got[i], expected[i], a[i], b[i]);
    EXPECT_TRUE(agreement.holds()) << "leaf " << i << ": " << agreement.describe();
  }
}

TEST_P(Lanes, EveryJobRunsExactlyOnceUnderRandomNesting) {
  const std::size_t total = rt_test::under_tsan ? 10'000 : 100'000;
  std::vector<std::atomic<int>> runs(total + 4096);
  std::atomic<std::size_t> next{0};
  // A call of `leaves` jobs at `depth`; each job may issue a nested call (depth ≤ 4).
  std::function<void(std::size_t, int)> call = [&](std::size_t leaves, int depth) {
    const std::size_t base = next.fetch_add(leaves);
    run_leaves("count", leaves, [&, base, depth](std::size_t i) {
      const std::size_t id = base + i;
      if (id < runs.size()) runs[id].fetch_add(1, std::memory_order_relaxed);
      const std::uint64_t r = mix(id);
      if (depth < 4 && r % 8 == 0 && next.load() < total) call(1 + (r >> 8) % 12, depth + 1);
    });
  };
  with_watchdog(60s, [&] {
    rt::StreamGuard guard(lanes());
    std::uint64_t seed = 1;
    while (next.load() < total) call(1 + (seed = mix(seed)) % 64, 0);
  });
  const std::size_t issued = std::min(next.load(), runs.size());
  ASSERT_GE(issued, total);
  std::size_t wrong = 0;
  for (std::size_t id = 0; id < issued; ++id) wrong += runs[id].load() != 1;
  EXPECT_EQ(wrong, 0u);
}

TEST_P(Lanes, NestedCallsFiveLevelsDeepComplete) {
  // Every leaf at depth d < 5 issues a call of 3 leaves: 3^5 = 243 leaves at the bottom.
  std::atomic<int> bottom{0};
  std::function<void(int)> level = [&](int depth) {
    run_leaves("nest", 3, [&, depth](std::size_t) {
      if (depth == 5)
        bottom.fetch_add(1);
      else
        level(depth + 1);
    });
  };
  with_watchdog(20s, [&] {
    rt::StreamGuard guard(lanes());
    for (int rep = 0; rep < 20; ++rep) level(1);
  });
  EXPECT_EQ(bottom.load(), 20 * 243);
}

TEST_P(Lanes, LeafErrorsKeepTypeNameLeafAndOpAndOthersStillRun) {
  std::vector<std::atomic<int>> ran(40);
  with_watchdog(20s, [&] {
    rt::StreamGuard guard(lanes());
    try {
      run_leaves("index_select", 40, [&](std::size_t i) {
        ran[i].fetch_add(1);
        if (i == 7) throw std::out_of_range("index 9 is out of bounds");
        if (i == 23) TORCH_CHECK_INDEX(false, "second failure");
      });
      ADD_FAILURE() << "no exception";
    } catch (const std::out_of_range& e) {
      EXPECT_EQ(std::string(e.what()),
                "index_select at leaf 'l7': index 9 is out of bounds; 1 other failure(s): "
                "'l23': second failure");
    }
    for (std::size_t i = 0; i < ran.size(); ++i) EXPECT_EQ(ran[i].load(), 1) << "leaf " << i;
    // The first failing leaf in leaf order decides the type, whichever lane threw first.
    try {
      run_leaves("add", 16, [&](std::size_t i) {
        if (i == 15) throw std::runtime_error("late");
        if (i == 3) TORCH_CHECK_INDEX(false, "early");
      });
      ADD_FAILURE() << "no exception";
    } catch (const c10::IndexError& e) {
      EXPECT_EQ(e.msg(), "add at leaf 'l3': early; 1 other failure(s): 'l15': late");
    }
    // Lanes stay usable.
    std::atomic<int> count{0};
    run_leaves("after", 100, [&](std::size_t) { count.fetch_add(1); });
    EXPECT_EQ(count.load(), 100);
  });
}

TEST_P(Lanes, NoGradModeIsCarriedIntoLanesAndGradientsFlowWithout) {
  constexpr std::size_t n = 16;
  std::vector<at::Tensor> x, y(n);
  for (std::size_t i = 0; i < n; ++i) x.push_back(at::full({3}, 1.0 + i).requires_grad_(true));
  with_watchdog(20s, [&] {
    rt::StreamGuard guard(lanes());
    {
      at::NoGradGuard no_grad;
      run_leaves("mul", n, [&](std::size_t i) { y[i] = x[i] * x[i]; });
    }
    for (std::size_t i = 0; i < n; ++i) EXPECT_FALSE(y[i].requires_grad()) << "leaf " << i;
    run_leaves("mul", n, [&](std::size_t i) { y[i] = x[i] * x[i]; });
  });
  at::Tensor total = at::zeros({});
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(y[i].requires_grad()) << "leaf " << i;
    total = total + y[i].sum();
  }
  total.backward();
  for (std::size_t i = 0; i < n; ++i)
    EXPECT_TRUE(at::equal(x[i].grad(), at::full({3}, 2.0 * (1.0 + i)))) << "leaf " << i;
}

TEST_P(Lanes, InferenceModeAutocastAndStreamModeAreCarried) {
  std::vector<int> inference(32, -1), autocast(32, -1);
  std::vector<rt::StreamMode> modes(32);
  with_watchdog(20s, [&] {
    rt::StreamGuard guard(lanes());
    c10::InferenceMode inference_mode;
    at::autocast::set_cpu_enabled(true);
    run_leaves("probe", 32, [&](std::size_t i) {
      std::this_thread::sleep_for(50us);  // let workers take part
      inference[i] = c10::InferenceMode::is_enabled();
      autocast[i] = at::autocast::is_cpu_enabled();
      modes[i] = rt::current_stream_mode();
    });
    at::autocast::set_cpu_enabled(false);
  });
  for (std::size_t i = 0; i < 32; ++i) {
    EXPECT_EQ(inference[i], 1) << "leaf " << i;
    EXPECT_EQ(autocast[i], 1) << "leaf " << i;
    EXPECT_EQ(modes[i], rt::StreamMode::of(lanes())) << "leaf " << i;
  }
}

// c10's warning handler is per thread: a leaf's warning reaches the caller's handler (Python's
// makes it a Python warning) from whichever lane ran it, one at a time.
TEST_P(Lanes, LeafWarningsReachTheCallersHandlerOneAtATime) {
  struct Count final : c10::WarningHandler {
    void process(const c10::Warning& w) override {
      EXPECT_EQ(inside.fetch_add(1), 0) << "two warnings at once";
      std::this_thread::sleep_for(20us);
      messages.insert(w.msg());
      threads.insert(std::this_thread::get_id());
      inside.fetch_sub(1);
    }
    std::atomic<int> inside{0};
    std::set<std::string> messages;  // touched one at a time, or the test fails above
    std::set<std::thread::id> threads;
  } count;
  with_watchdog(20s, [&] {
    rt::StreamGuard guard(lanes());
    c10::WarningUtils::WarningHandlerGuard handler(&count);
    run_leaves("warn", 32, [&](std::size_t i) {
      std::this_thread::sleep_for(50us);  // let workers take part
      TORCH_WARN("leaf ", i);
    });
  });
  EXPECT_EQ(count.messages.size(), 32u);  // every leaf's, none to stderr
  // Workers' warnings among them: a worker's own c10 handler would have printed them.
  if (lanes() > 1) EXPECT_GT(count.threads.size(), 1u);
}

TEST_P(Lanes, LeavesRunWithOneIntraOpAndOneBlasThreadRestoredAfterwards) {
  if (lanes() == 1) {
    GTEST_SKIP() << "linear calls leave kernel threads alone";
  }
  // Give the caller two intra-op threads so that "one inside lanes" is a real restriction.
  const int aten_threads = at::get_num_threads();
  at::set_num_threads(2);
  const int omp_before = rt::detail::omp_threads();
  const int blas_before = rt::detail::blas_threads();
  std::vector<int> omp(64, -1), blas(64, -1), aten(64, -1);
  with_watchdog(20s, [&] {
    rt::StreamGuard guard(lanes());
    run_leaves("probe", 64, [&](std::size_t i) {
      omp[i] = rt::detail::omp_threads();
      blas[i] = rt::detail::blas_threads();
      aten[i] = at::get_num_threads();
      std::this_thread::sleep_for(100us);  // let workers take part
    });
  });
  for (std::size_t i = 0; i < 64; ++i) {
    // Without OpenMP or OpenBLAS loaded (0), there is nothing to restrict.
    EXPECT_EQ(omp[i], omp_before != 0 ? 1 : 0) << "leaf " << i;
    EXPECT_EQ(blas[i], blas_before != 0 ? 1 : 0) << "leaf " << i;
    if (omp_before != 0) {
      EXPECT_EQ(aten[i], 1) << "leaf " << i;
    }
  }
  EXPECT_EQ(rt::detail::omp_threads(), omp_before);
  EXPECT_EQ(rt::detail::blas_threads(), blas_before);
  EXPECT_EQ(at::get_num_threads(), 2);
  at::set_num_threads(aten_threads);
}

TEST_P(Lanes, WorkersTakePartAndCallerToo) {
  if (lanes() == 1) {
    GTEST_SKIP();
  }
  std::mutex m;
  std::set<std::thread::id> threads;
  with_watchdog(20s, [&] {
    rt::StreamGuard guard(lanes());
    for (int rep = 0; rep < 20 && threads.size() < 2; ++rep)
      run_leaves("probe", 64, [&](std::size_t) {
        std::this_thread::sleep_for(200us);
        std::lock_guard lock(m);
        threads.insert(std::this_thread::get_id());
      });
  });
  EXPECT_GE(threads.size(), 2u);
  EXPECT_LE(threads.size(), lanes());
  EXPECT_TRUE(threads.count(std::this_thread::get_id()));
}

TEST_P(Lanes, CallsFromManyThreadsAtOnce) {
  constexpr int callers = 4;
  std::atomic<long> sum{0};
  with_watchdog(30s, [&] {
    std::vector<std::thread> threads;
    for (int t = 0; t < callers; ++t)
      threads.emplace_back([&] {
        rt::StreamGuard guard(lanes());
        for (int rep = 0; rep < 200; ++rep)
          run_leaves("sum", 50, [&](std::size_t i) { sum.fetch_add(static_cast<long>(i)); });
      });
    for (auto& t : threads) t.join();
  });
  EXPECT_EQ(sum.load(), callers * 200L * (49 * 50 / 2));
}

INSTANTIATE_TEST_SUITE_P(Lanes, Lanes, ::testing::Values(1, 2, 4, 8),
                         [](const auto& info) { return "lanes" + std::to_string(info.param); });

TEST(LaneFork, AForkedChildStartsItsOwnWorkers) {
  if (rt_test::under_tsan) GTEST_SKIP() << "ThreadSanitizer ends children that start threads";
  {
    rt::StreamGuard guard(2);
    run_leaves("parent", 8, [](std::size_t) {});
  }
  ASSERT_GE(rt::detail::worker_count(), 1u);
  const int status = rt_test::in_forked_child(20s, [] {
    if (rt::detail::worker_count() != 0) return 1;  // the parent's are not in this process
    std::mutex m;
    std::set<std::thread::id> threads;
    std::atomic<int> ran{0};
    int reps = 0;
    rt::StreamGuard guard(2);
    for (; reps < 50 && threads.size() < 2; ++reps)
      run_leaves("child", 16, [&](std::size_t) {
        std::this_thread::sleep_for(200us);
        ++ran;
        std::lock_guard lock(m);
        threads.insert(std::this_thread::get_id());
      });
    if (rt::detail::worker_count() != 1) return 2;
    return threads.size() == 2 && ran == 16 * reps ? 0 : 3;
  });
  EXPECT_EQ(status, 0) << "1: parent's workers counted, 2: none started, 3: no worker took "
                          "part or a leaf did not run once, -1: hung";
}

TEST(LaneIdle, IdleLanesUseNoCpu) {
  {
    rt::StreamGuard guard(8);
    std::atomic<int> n{0};
    for (int rep = 0; rep < 50; ++rep) run_leaves("warm", 64, [&](std::size_t) { n.fetch_add(1); });
    ASSERT_EQ(n.load(), 50 * 64);
  }
  ASSERT_GE(rt::detail::worker_count(), 7u);
  std::this_thread::sleep_for(50ms);  // past the spin window
  auto cpu_seconds = [] {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
  };
  const double before = cpu_seconds();
  std::this_thread::sleep_for(200ms);
  const double used = cpu_seconds() - before;
  EXPECT_LT(used, 0.01) << "seven parked workers used " << used * 1e3 << " ms of CPU in 200 ms";
}

TEST(LaneModes, ProcessWideModeGuardPrecedenceAndValidation) {
  EXPECT_EQ(rt::current_stream_mode(), rt::StreamMode::of(1));
  rt::stream(3);
  EXPECT_EQ(rt::current_stream_mode(), rt::StreamMode::of(3));
  {
    rt::StreamGuard outer(rt::automatic);
    EXPECT_EQ(rt::current_stream_mode().kind, rt::StreamMode::Kind::automatic);
    {
      rt::StreamGuard inner(rt::fused);
      EXPECT_EQ(rt::current_stream_mode(), rt::StreamMode::of(rt::fused));
    }
    EXPECT_EQ(rt::current_stream_mode().kind, rt::StreamMode::Kind::automatic);
    // Another thread sees the process-wide mode, not this thread's guard.
    rt::StreamMode seen;
    std::thread([&] { seen = rt::current_stream_mode(); }).join();
    EXPECT_EQ(seen, rt::StreamMode::of(3));
  }
  EXPECT_EQ(rt::current_stream_mode(), rt::StreamMode::of(3));
  rt::stream(1);
  EXPECT_THROW(rt::stream(0), std::invalid_argument);
  EXPECT_THROW(rt::StreamGuard(rt::max_lanes + 1), std::invalid_argument);
  EXPECT_EQ(rt::current_stream_mode(), rt::StreamMode::of(1));
  EXPECT_EQ(rt::StreamMode::of(2).to_string(), "stream(2)");
}

TEST(LaneModes, InlineEnvironmentRunsEverythingOnTheCaller) {
  // Re-executes this test alone in a child, where the environment is read for the first time.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("TREETENSOR_INLINE", "1", 1);
        rt::StreamGuard guard(4);
        const auto self = std::this_thread::get_id();
        std::atomic<int> elsewhere{0};
        run_leaves("probe", 64, [&](std::size_t) {
          std::this_thread::sleep_for(50us);
          elsewhere += std::this_thread::get_id() != self;
        });
        std::_Exit(elsewhere.load() == 0 && rt::detail::worker_count() == 0 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(LaneModes, SpinEnvironmentIsReadAtTheFirstCallAndABadValueIsAnError) {
  // Each case in a child, where the environment is read for the first time.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("TREETENSOR_SPIN_US", "200", 1);
        run_leaves("probe", 2, [](std::size_t) {});
        std::_Exit(rt::detail::spin_microseconds() == 200 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
  for (const char* bad : {"abc", "-1", "1000001"}) {
    SCOPED_TRACE(bad);
    EXPECT_EXIT(
        {
          setenv("TREETENSOR_SPIN_US", bad, 1);
          int code = 1;
          for (int call = 0; call < 2; ++call) {  // every call, not only the first
            try {
              run_leaves("probe", 2, [](std::size_t) {});
              code = 2;
            } catch (const std::invalid_argument& e) {
              const std::string want =
                  std::string("TREETENSOR_SPIN_US='") + bad + "' must be an integer in 0..1000000";
              if (std::string(e.what()).find(want) == std::string::npos) code = 3;
            }
          }
          std::_Exit(code == 1 ? 0 : code);
        },
        ::testing::ExitedWithCode(0), "");
  }
}

// The first automatic decision calibrates (a hand-off round trip to a worker). When that first
// use happens inside leaves that occupy every lane, nobody can answer the ping: calibration must
// fall back instead of waiting. No other test in this program uses automatic mode.
TEST(LaneModes, FirstAutomaticCallInsideBusyLanesCompletes) {
  std::atomic<int> inner{0};
  rt_test::with_watchdog(20s, [&] {
    rt::StreamGuard guard(2);
    run_leaves("outer", 2, [&](std::size_t) {
      std::this_thread::sleep_for(2ms);  // both lanes busy
      rt::StreamGuard automatic(rt::automatic);
      run_leaves("inner", 8, [&](std::size_t) { inner.fetch_add(1); });
    });
  });
  EXPECT_EQ(inner.load(), 16);
}
