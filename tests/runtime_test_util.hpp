#pragma once
// Helpers shared by the runtime tests: one-line tree calls, a deadlock watchdog, a forked child.

#include "treetensor/runtime/dispatch.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
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
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool under_asan = true;
#else
inline constexpr bool under_asan = false;
#endif

/// The exit status of child process `pid`, or -1 when it did not end within `limit` (then it is
/// killed) or ended by a signal.
inline int wait_for_child(pid_t pid, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      std::fprintf(stderr, "forked child still running after %lld s (hung): killed\n",
                   static_cast<long long>(limit.count()));
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/// Runs `body` in a forked child and returns its exit status: body's result, 100 when it
/// threw (the message on stderr), -1 when the child did not end within `limit` (killed) or
/// the fork failed. The child never returns into the test framework.
template <class F>
int in_forked_child(std::chrono::seconds limit, F&& body) {
  std::fflush(nullptr);  // nothing buffered is written twice
  const pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    int code = 100;
    try {
      code = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "forked child: %s\n", e.what());
    }
    std::fflush(nullptr);
    _exit(code);
  }
  return wait_for_child(pid, limit);
}

}  // namespace rt_test
