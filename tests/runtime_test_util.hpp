#pragma once
// Helpers shared by the runtime tests: one-line tree calls and a deadlock watchdog.

#include "treetensor/runtime/dispatch.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

namespace rt_test {

inline std::string leaf_label(std::size_t i) {
  return "l" + std::to_string(i);
}

/// runtime::run over `leaves` leaves labelled l0, l1, ... with `fn(i)` as the leaf job.
template <class F>
void run_leaves(std::string_view op, std::size_t leaves, F&& fn) {
  auto label = [](std::size_t i) { return leaf_label(i); };
  treetensor::runtime::LeafCall call;
  call.op = op;
  call.leaves = leaves;
  call.run = fn;
  call.label = label;
  treetensor::runtime::run(call);
}

/// Runs `body` on this thread; if it has not finished within `limit`, reports a deadlock and
/// ends the process, so a hang fails fast instead of waiting for the ctest timeout.
template <class F>
void with_watchdog(std::chrono::seconds limit, F&& body) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::thread dog([&] {
    std::unique_lock lock(m);
    if (!cv.wait_for(lock, limit, [&] { return done; })) {
      std::fprintf(stderr, "watchdog: test body still running after %lld s (deadlock?)\n",
                   static_cast<long long>(limit.count()));
      std::_Exit(3);
    }
  });
  struct Finish {
    std::mutex& m;
    std::condition_variable& cv;
    bool& done;
    std::thread& dog;
    ~Finish() {
      {
        std::lock_guard lock(m);
        done = true;
      }
      cv.notify_all();
      dog.join();
    }
  } finish{m, cv, done, dog};
  body();
}

#if defined(__SANITIZE_THREAD__)
inline constexpr bool under_tsan = true;
#else
inline constexpr bool under_tsan = false;
#endif

}  // namespace rt_test
