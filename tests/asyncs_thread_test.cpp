// asyncs threads: FIFO, futures, errors, pool, scopes, watchdog, back-pressure, destruction.
#include "asyncs/internal.hpp"
#include "asyncs_test_util.hpp"
#include "runtime_test_util.hpp"

#include "treetensor/runtime/stream.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace rt = treetensor::runtime;
namespace asyncs = treetensor::asyncs;
using treetensor::testing::AsyncsTest;
using treetensor::testing::contains;
using treetensor::testing::Gate;
using treetensor::testing::tree_call;
using namespace std::chrono_literals;

namespace {

using AsyncsThread = AsyncsTest;

TEST_F(AsyncsThread, JobsOfOneThreadRunInSubmissionOrder) {
  asyncs::Thread t;
  std::vector<int> order;  // touched by the worker only, read after wait_idle
  std::vector<asyncs::Future<void>> futures;
  for (int i = 0; i < 200; ++i) futures.push_back(t.submit([&order, i] { order.push_back(i); }));
  t.wait_idle();
  ASSERT_EQ(order.size(), 200u);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(order[i], i);
  for (std::size_t i = 0; i < futures.size(); ++i) {
    EXPECT_TRUE(futures[i].ready());
    EXPECT_EQ(futures[i].job(), i + 1);
    EXPECT_EQ(futures[i].thread_id(), t.id());
  }
}

TEST_F(AsyncsThread, FuturesCarryValuesOfAnyType) {
  asyncs::Thread t;
  const at::Tensor x = at::arange(6, at::kFloat).reshape({2, 3});
  auto sum = t.submit([x] { return x.sum(); }, {x}, {});
  auto text = t.submit([] { return std::string("metrics"); });
  auto owned = t.submit([p = std::make_unique<int>(7)] { return std::make_unique<int>(*p * 6); });
  int side = 0;
  auto none = t.submit([&side] { side = 3; });
  EXPECT_EQ(sum.get().item<float>(), 15.0f);
  EXPECT_EQ(text.get(), "metrics");
  EXPECT_EQ(*owned.get(), 42);
  none.get();
  EXPECT_EQ(side, 3);
  EXPECT_EQ(text.get(), "metrics") << "get() may be called again";
}

TEST_F(AsyncsThread, JobsRunOnTheirWorkerWithTheSubmittersGradAndStreamMode) {
  asyncs::Thread t;
  EXPECT_EQ(asyncs::current_thread_id(), std::nullopt);
  auto where = t.submit([] { return asyncs::current_thread_id(); });
  auto grad_on = t.submit([] { return at::GradMode::is_enabled(); });
  asyncs::Future<bool> grad_off;
  asyncs::Future<rt::StreamMode> three_lanes;
  {
    at::NoGradGuard no_grad;
    rt::StreamGuard lanes(3);
    grad_off = t.submit([] { return at::GradMode::is_enabled(); });
    three_lanes = t.submit([] { return rt::current_stream_mode(); });
  }
  auto default_mode = t.submit([] { return rt::current_stream_mode(); });
  EXPECT_EQ(where.get(), t.id());
  EXPECT_TRUE(grad_on.get());
  EXPECT_FALSE(grad_off.get());
  EXPECT_EQ(three_lanes.get(), rt::StreamMode::of(3));
  EXPECT_EQ(default_mode.get(), rt::current_stream_mode());
}

TEST_F(AsyncsThread, JobErrorReachesGetWithItsTypeAndContext) {
  asyncs::Thread t;
  auto f = t.submit([]() -> int { throw std::out_of_range("index 9 of 3"); }, {}, {}, "lookup");
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      f.get();
      FAIL() << "get() must rethrow";
    } catch (const std::out_of_range& e) {
      EXPECT_EQ(std::string(e.what()),
                "asyncs thread " + std::to_string(t.id()) + ", job 1 'lookup': index 9 of 3");
    }
  }
  auto g = t.submit([] { TORCH_CHECK_INDEX(false, "torch index error"); });
  try {
    g.wait();
    FAIL() << "wait() must rethrow";
  } catch (const c10::IndexError& e) {
    EXPECT_TRUE(contains(e.what_without_backtrace(), ", job 2: torch index error"));
  }
  EXPECT_NO_THROW(rt::synchronize()) << "errors seen by get()/wait() are not reported again";
  EXPECT_EQ(t.submit([] { return 5; }).get(), 5) << "the thread stays usable";
}

TEST_F(AsyncsThread, UnobservedErrorsAllSurfaceAtSynchronize) {
  asyncs::Thread a;
  asyncs::Thread b;
  a.submit([] { throw std::invalid_argument("first"); });
  b.submit([] { return 1; });
  b.submit([] { throw std::runtime_error("second"); });
  a.submit([] { throw std::domain_error("third"); });
  try {
    rt::synchronize();
    FAIL() << "synchronize() must report the errors";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_TRUE(contains(what, "asyncs thread " + std::to_string(a.id()) + ", job 1: first"));
    EXPECT_TRUE(contains(what, "2 other failure(s)"));
    EXPECT_TRUE(contains(what, "asyncs thread " + std::to_string(b.id()) + ", job 2: second"));
    EXPECT_TRUE(contains(what, "asyncs thread " + std::to_string(a.id()) + ", job 2: third"));
  }
  EXPECT_NO_THROW(rt::synchronize()) << "each error is reported once";
  EXPECT_EQ(a.submit([] { return 2; }).get(), 2);
}

TEST_F(AsyncsThread, PoolExhaustionIsATypedErrorAndIdsAreReused) {
  std::vector<std::unique_ptr<asyncs::Thread>> threads;
  for (std::size_t i = 0; i < asyncs::max_threads(); ++i)
    threads.push_back(std::make_unique<asyncs::Thread>());
  for (std::size_t i = 0; i < threads.size(); ++i)
    EXPECT_EQ(threads[i]->id(), static_cast<int>(i) + 1);
  try {
    asyncs::Thread extra;
    FAIL() << "the pool must be exhausted";
  } catch (const asyncs::ThreadPoolExhausted& e) {
    EXPECT_TRUE(contains(e.what(), "TREETENSOR_ASYNCS_THREADS"));
  }
  const int freed = threads.back()->id();
  threads.back().reset();
  asyncs::Thread again;
  EXPECT_EQ(again.id(), freed);
}

TEST_F(AsyncsThread, ScopesRunTreeCallsOnTheirThreadAndNest) {
  asyncs::Thread outer;
  asyncs::Thread inner;
  const auto where = [] {
    std::optional<int> id;
    tree_call("where", 1, [&](std::size_t) { id = asyncs::current_thread_id(); });
    return id;
  };
  EXPECT_EQ(where(), std::nullopt);
  {
    asyncs::ThreadScope a(outer);
    EXPECT_EQ(where(), outer.id());
    {
      asyncs::ThreadScope b(inner);
      EXPECT_EQ(where(), inner.id());
    }
    EXPECT_EQ(where(), outer.id()) << "the outer scope is restored";
  }
  EXPECT_EQ(where(), std::nullopt);
}

TEST_F(AsyncsThread, ScopedTreeCallRunsAfterEarlierSubmitsAndReportsErrors) {
  asyncs::Thread t;
  std::vector<std::string> log;  // written by the worker only
  Gate gate;
  t.submit([&log, wait = gate.waiter()] {
    wait();
    log.push_back("submitted job");
  });
  std::thread opener([&] {
    std::this_thread::sleep_for(20ms);
    gate.open();
  });
  {
    asyncs::ThreadScope scope(t);
    tree_call("append", 2, [&](std::size_t i) { log.push_back("leaf" + std::to_string(i)); });
    EXPECT_EQ(log, (std::vector<std::string>{"submitted job", "leaf0", "leaf1"}));
    try {
      tree_call("boom", 1, [](std::size_t) { throw std::range_error("bad leaf"); });
      FAIL() << "the scoped call must rethrow";
    } catch (const std::range_error& e) {
      EXPECT_TRUE(contains(e.what(), "asyncs thread " + std::to_string(t.id())));
      EXPECT_TRUE(contains(e.what(), "bad leaf"));
    }
  }
  opener.join();
}

TEST_F(AsyncsThread, NestedTreeCallsInsideJobsKnowTheirThread) {
  asyncs::Thread t;
  auto f = t.submit([] {
    std::vector<std::optional<int>> ids(4);
    tree_call("outer", 2, [&](std::size_t i) {
      tree_call("inner", 2, [&](std::size_t j) { ids[2 * i + j] = asyncs::current_thread_id(); });
    });
    return ids;
  });
  for (const auto& id : f.get()) EXPECT_EQ(id, t.id());
}

TEST_F(AsyncsThread, WaitsThatCouldOnlyDeadlockAreUsageErrors) {
  asyncs::Thread t;
  Gate gate;
  asyncs::Future<void> later;
  auto first = t.submit([&later, wait = gate.waiter()] {
    wait();
    try {
      later.wait();
    } catch (const asyncs::AsyncsUsageError&) {
      try {
        rt::synchronize();
      } catch (const asyncs::AsyncsUsageError&) {
        return true;
      }
    }
    return false;
  });
  later = t.submit([] {});
  gate.open();
  EXPECT_TRUE(first.get());
  EXPECT_THROW(asyncs::Future<int>().get(), asyncs::AsyncsUsageError);
}

// Each of two jobs waits for work queued behind the other: the second wait to start closes
// a cycle in the wait-for graph and is refused at once (the fixture's 10 s watchdog turns a
// regression into a failure, not a hang); the other wait then completes.
template <class Wait>
void expect_one_cycle_error(Wait wait_for_other) {
  asyncs::Thread a, b;
  Gate gate;
  asyncs::Future<int> behind_a, behind_b;
  const auto job = [&](asyncs::Future<int>& other, asyncs::Thread& on) {
    return [&other, &on, wait = gate.waiter(), wait_for_other]() -> std::string {
      wait();
      try {
        wait_for_other(other, on);
      } catch (const asyncs::AsyncsUsageError& e) {
        return e.what();
      }
      return "";
    };
  };
  auto on_a = a.submit(job(behind_b, b));
  auto on_b = b.submit(job(behind_a, a));
  behind_a = a.submit([] { return 1; });
  behind_b = b.submit([] { return 2; });
  gate.open();
  const std::string ea = on_a.get(), eb = on_b.get();
  EXPECT_TRUE(ea.empty() != eb.empty())
      << "exactly one wait refused: '" << ea << "' '" << eb << "'";
  const std::string& e = ea.empty() ? eb : ea;
  EXPECT_TRUE(contains(e, "would close a cycle of waits")) << e;
  EXPECT_TRUE(contains(e, "asyncs thread " + std::to_string(a.id()))) << e;
  EXPECT_TRUE(contains(e, "asyncs thread " + std::to_string(b.id()))) << e;
  EXPECT_EQ(behind_a.get() + behind_b.get(), 3);
}

TEST_F(AsyncsThread, FuturesWaitingOnEachOtherAreAUsageErrorAtOnce) {
  expect_one_cycle_error([](const asyncs::Future<int>& other, asyncs::Thread&) { other.get(); });
}

TEST_F(AsyncsThread, ScopesWaitingOnEachOtherAreAUsageErrorAtOnce) {
  expect_one_cycle_error([](const asyncs::Future<int>&, asyncs::Thread& on) {
    asyncs::ThreadScope scope(on);
    tree_call("cycle", 1, [](std::size_t) {});
  });
}

TEST_F(AsyncsThread, WaitIdleOnEachOtherIsAUsageErrorAtOnce) {
  expect_one_cycle_error([](const asyncs::Future<int>&, asyncs::Thread& on) { on.wait_idle(); });
}

TEST_F(AsyncsThread, WatchdogNamesTheBlockedJobWithinASecond) {
  asyncs::set_watchdog_timeout(50ms);
  asyncs::Thread t("blocker");
  Gate gate;
  auto f = t.submit(
      [wait = gate.waiter()] {
        wait();
        return 11;
      },
      {}, {}, "blocked on latch");
  const auto start = std::chrono::steady_clock::now();
  try {
    f.get();
    FAIL() << "the watchdog must fire";
  } catch (const asyncs::WatchdogTimeout& e) {
    EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
    EXPECT_TRUE(contains(e.what(), "'blocked on latch' running"));
    ASSERT_EQ(e.jobs().size(), 1u);
    EXPECT_EQ(e.jobs()[0].thread, t.id());
    EXPECT_EQ(e.jobs()[0].job, 1u);
    EXPECT_TRUE(e.jobs()[0].running);
  }
  EXPECT_THROW(rt::synchronize(), asyncs::WatchdogTimeout);
  gate.open();
  EXPECT_EQ(f.get(), 11) << "the job completes once released";
}

TEST_F(AsyncsThread, WatchdogWithdrawsAQueuedScopedCall) {
  asyncs::set_watchdog_timeout(50ms);
  asyncs::Thread t;
  Gate gate;
  t.submit(gate.waiter(), {}, {}, "blocker");
  bool ran = false;
  {
    asyncs::ThreadScope scope(t);
    EXPECT_THROW(tree_call("never", 1, [&](std::size_t) { ran = true; }), asyncs::WatchdogTimeout);
  }
  gate.open();
  t.wait_idle();
  EXPECT_FALSE(ran) << "a withdrawn call never runs (it borrowed the caller's stack)";
}

TEST_F(AsyncsThread, BackPressureBlocksTheSubmitterUntilTheQueueDrains) {
  asyncs::set_max_in_flight(2);
  asyncs::Thread t;
  Gate gate;
  std::vector<int> order;
  t.submit([&order, wait = gate.waiter()] {
    wait();
    order.push_back(1);
  });
  t.submit([&order] { order.push_back(2); });
  std::atomic<bool> submitted{false};
  std::thread submitter([&] {
    t.submit([&order] { order.push_back(3); });
    submitted = true;
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(submitted) << "a third job past the high-water mark of 2 must block";
  EXPECT_EQ(t.in_flight(), 2u);
  gate.open();
  submitter.join();
  EXPECT_TRUE(submitted);
  t.wait_idle();
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
}

// The marks a caller waits for in slices (Python's Ctrl-C between them): false while the work
// is blocked, true once it is done, never moved by work submitted after the mark; neither
// reports the work's errors.
TEST_F(AsyncsThread, WorkMarksSayWhetherTheWorkSubmittedBeforeThemIsDone) {
  asyncs::Thread t;
  asyncs::Thread other;
  Gate gate;
  auto blocked = t.submit([wait = gate.waiter()] { wait(); });
  auto failing = other.submit([]() -> int { throw std::runtime_error("left for synchronize"); });
  const asyncs::WorkMark all = asyncs::mark_all(), mine = t.mark();
  EXPECT_FALSE(mine.wait_for(20ms));
  EXPECT_FALSE(all.wait_for(20ms));
  EXPECT_FALSE(blocked.wait_for(20ms));
  EXPECT_TRUE(other.mark().wait_for(10s));  // its failed job is done, its error not reported
  EXPECT_TRUE(failing.ready());
  gate.open();
  EXPECT_TRUE(mine.wait_for(10s));
  Gate later;
  t.submit([wait = later.waiter()] { wait(); });  // after the marks: they stay reached
  EXPECT_TRUE(all.wait_for(10s));
  EXPECT_TRUE(mine.wait_for(0ms));
  EXPECT_FALSE(t.mark().wait_for(20ms));
  later.open();
  EXPECT_THROW(rt::synchronize(), std::runtime_error);  // reported here, once
  t.close();
  EXPECT_TRUE(t.mark().wait_for(0ms));
}

TEST_F(AsyncsThread, DestructorDrainsPendingJobsAndKeepsTheirErrors) {
  std::atomic<int> ran{0};
  int id = 0;
  {
    asyncs::Thread t;
    id = t.id();
    for (int i = 0; i < 10; ++i) {
      t.submit([&ran, i] {
        std::this_thread::sleep_for(2ms);
        ++ran;
        if (i == 4) throw std::overflow_error("job five failed");
      });
    }
  }
  EXPECT_EQ(ran.load(), 10) << "the destructor waits for every pending job";
  try {
    rt::synchronize();
    FAIL() << "the un-got error must surface";
  } catch (const std::overflow_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "asyncs thread " + std::to_string(id) + ", job 5: job five failed");
  }
}

TEST_F(AsyncsThread, CloseDrainsFreesTheIdAndLeavesADefinedClosedThread) {
  asyncs::Thread t;
  const int id = t.id();
  std::atomic<int> ran{0};
  for (int i = 0; i < 5; ++i)
    t.submit([&ran] {
      std::this_thread::sleep_for(2ms);
      ++ran;
    });
  t.close();
  EXPECT_EQ(ran.load(), 5) << "close() drains as the destructor does";
  EXPECT_TRUE(t.closed());
  EXPECT_EQ(t.id(), id) << "the id stays readable";
  EXPECT_EQ(t.in_flight(), 0u);
  EXPECT_NO_THROW(t.wait_idle());
  EXPECT_NO_THROW(t.close()) << "a second close does nothing";
  try {
    t.submit([] { return 1; });
    FAIL() << "submit after close must throw";
  } catch (const asyncs::AsyncsUsageError& e) {
    EXPECT_TRUE(contains(e.what(), "asyncs thread " + std::to_string(id) + " is closed"))
        << e.what();
  }
  EXPECT_THROW(asyncs::ThreadScope{t}, asyncs::AsyncsUsageError);
  asyncs::Thread next;  // the freed id is taken again
  EXPECT_EQ(next.id(), id);
  asyncs::Thread moved(std::move(t));
  EXPECT_TRUE(moved.closed());
  EXPECT_EQ(moved.id(), id);
}

TEST_F(AsyncsThread, DestroyedFromItsOwnJobDetachesRunsItsQueueAndFreesItsId) {
  asyncs::set_watchdog_timeout(
      2s);  // a destructor that drains here waits for itself: fail, not hang
  Gate gate;
  auto* t = new asyncs::Thread();
  const int id = t->id();
  t->submit(gate.waiter());
  auto deleting = t->submit([t] { delete t; });
  auto behind = t->submit([] { return asyncs::current_thread_id(); });
  ::testing::internal::CaptureStderr();
  gate.open();
  EXPECT_NO_THROW(deleting.get());
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(
      contains(err, "asyncs thread " + std::to_string(id) + " destroyed from its own job 2"));
  EXPECT_EQ(behind.get(), id) << "a job queued behind the deleting one still runs on its worker";
  // The worker frees its id once its queue has run: the whole pool becomes constructible.
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  for (;;) {
    try {
      std::vector<asyncs::Thread> all;
      all.reserve(asyncs::max_threads());
      for (std::size_t i = 0; i < asyncs::max_threads(); ++i) all.emplace_back();
      break;
    } catch (const asyncs::ThreadPoolExhausted&) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "id " << id << " never freed";
      std::this_thread::sleep_for(5ms);
    }
  }
}

TEST_F(AsyncsThread, AForkedChildFailsInFlightJobsRefusesOldThreadsAndStartsNewOnes) {
  if (rt_test::under_tsan) GTEST_SKIP() << "ThreadSanitizer ends children that start threads";
  Gate gate;
  asyncs::Thread t;
  t.submit(gate.waiter());
  auto queued = t.submit([] { return 7; });
  const int status = rt_test::in_forked_child(20s, [&] {
    try {
      queued.get();
      return 1;
    } catch (const asyncs::AsyncsUsageError& e) {
      if (std::string(e.what()).find("in flight when the process forked") == std::string::npos)
        return 2;
    }
    try {
      t.submit([] {});
      return 3;
    } catch (const asyncs::AsyncsUsageError& e) {
      if (std::string(e.what()).find("started before this process forked") == std::string::npos)
        return 4;
    }
    try {
      rt::synchronize();  // the gate's job: in flight at the fork, never observed
      return 5;
    } catch (const asyncs::AsyncsUsageError&) {
    }
    t.close();  // returns at once: nothing to drain or join here
    asyncs::Thread fresh;
    if (fresh.id() != 1 || fresh.submit([] { return 6; }).get() != 6) return 6;
    return 0;
  });
  EXPECT_EQ(status, 0) << "the step that failed (see the test), -1: hung";
  gate.open();
  EXPECT_EQ(queued.get(), 7) << "the parent is unaffected";
}

TEST_F(AsyncsThread, AChildForkedInsideAJobIsNoWorkerAndEndsWhenTheJobReturns) {
  if (rt_test::under_tsan) GTEST_SKIP() << "ThreadSanitizer ends children that start threads";
  asyncs::Thread t;
  const pid_t pid = t.submit([] {
                       const pid_t p = fork();
                       if (p != 0) return p;
                       // The child: this job runs on, on a thread that is no worker here.
                       if (asyncs::current_thread_id()) _exit(2);
                       asyncs::Thread fresh;
                       if (fresh.submit([] { return 6; }).get() != 6) _exit(3);
                       return p;  // the job returns: the child ends, status 0
                     }).get();
  ASSERT_GT(pid, 0);
  EXPECT_EQ(rt_test::wait_for_child(pid, 20s), 0)
      << "2: the child's thread is a worker, 3: no new worker, -1: hung or killed";
}

TEST(AsyncsEnv, CountsParseStrictlyWithTheirRangeInTheError) {
  using asyncs::detail::parse_env_count;
  const char* wd = "TREETENSOR_WATCHDOG_MS";
  EXPECT_EQ(parse_env_count(wd, "0", 0, 0, 86'400'000), 0u) << "0 means off and is valid";
  EXPECT_EQ(parse_env_count(wd, "250", 0, 0, 86'400'000), 250u);
  EXPECT_EQ(parse_env_count(wd, nullptr, 7, 0, 86'400'000), 7u);
  EXPECT_EQ(parse_env_count(wd, "", 7, 0, 86'400'000), 7u);
  for (const char* bad : {"-5", "abc", " 5", "+5", "5x", "86400001", "99999999999999999999"}) {
    try {
      parse_env_count(wd, bad, 0, 0, 86'400'000);
      ADD_FAILURE() << "'" << bad << "' accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_TRUE(contains(e.what(), std::string("TREETENSOR_WATCHDOG_MS='") + bad +
                                         "' must be an integer in 0..86400000"));
    }
  }
  EXPECT_THROW(parse_env_count("TREETENSOR_ASYNCS_MAX_IN_FLIGHT", "0", 1024, 1, 1 << 30),
               std::invalid_argument);
}

// The environment is read once per process: each case runs in a fresh child (threadsafe death
// test style re-executes the binary), sets the variable, and exits 0 only on the right outcome.
[[noreturn]] void expect_thread_rejects(const char* name, const char* value) {
  setenv(name, value, 1);
  std::fprintf(stderr, "watchdog %lld ms, max_in_flight %zu\n",
               static_cast<long long>(asyncs::watchdog_timeout().count()), asyncs::max_in_flight());
  try {
    asyncs::Thread t;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::exit(0);
  }
  std::exit(1);
}

TEST(AsyncsEnv, InvalidVariablesMakeThreadThrowInsteadOfTerminating) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(expect_thread_rejects("TREETENSOR_WATCHDOG_MS", "-5"), ::testing::ExitedWithCode(0),
              "watchdog 0 ms.*TREETENSOR_WATCHDOG_MS='-5' must be an integer in 0..86400000");
  EXPECT_EXIT(expect_thread_rejects("TREETENSOR_ASYNCS_MAX_IN_FLIGHT", "0"),
              ::testing::ExitedWithCode(0),
              "max_in_flight 1024.*TREETENSOR_ASYNCS_MAX_IN_FLIGHT='0' must be an integer in 1..");
}

[[noreturn]] void run_with_watchdog_env_zero() {
  setenv("TREETENSOR_WATCHDOG_MS", "0", 1);
  asyncs::Thread t;
  std::exit(t.submit([] { return 42; }).get() == 42 && asyncs::watchdog_timeout().count() == 0 ? 0
                                                                                               : 1);
}

TEST(AsyncsEnv, WatchdogZeroMeansOff) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_with_watchdog_env_zero(), ::testing::ExitedWithCode(0), "");
}

[[noreturn]] void exit_with_an_unobserved_error() {
  {
    asyncs::Thread t;
    t.submit([] { throw std::runtime_error("lost at exit"); });
  }
  std::exit(0);
}

TEST(AsyncsExit, UnobservedErrorsArePrintedAtExit) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exit_with_an_unobserved_error(), ::testing::ExitedWithCode(0),
              "treetensor: asyncs thread [0-9]+, job 1: error never observed: lost at exit");
}

}  // namespace
