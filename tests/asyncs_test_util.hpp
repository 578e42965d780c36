#pragma once
// Helpers shared by the asyncs tests.

#include "treetensor/asyncs/thread.hpp"
#include "treetensor/runtime/dispatch.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <future>
#include <string>
#include <string_view>

namespace treetensor::testing {

/// Runs a tree call of `leaves` leaf jobs through runtime::run, as the tensor layer would.
inline void tree_call(std::string_view op, std::size_t leaves,
                      const std::function<void(std::size_t)>& leaf) {
  const std::function<std::string(std::size_t)> label = [](std::size_t i) {
    return "leaf" + std::to_string(i);
  };
  runtime::LeafCall call{.op = op, .leaves = leaves, .run = leaf, .label = label};
  runtime::run(call);
}

/// Whether `text` contains `part`, with both in the failure message.
inline ::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

/// A gate a job can block on until the test opens it.
class Gate {
 public:
  void open() { promise_.set_value(); }
  std::function<void()> waiter() const {
    return [f = future_] { f.wait(); };
  }

 private:
  std::promise<void> promise_;
  std::shared_future<void> future_ = promise_.get_future().share();
};

/// Every asyncs test runs with a watchdog (a hang fails instead of eating the ctest timeout)
/// and must leave no unobserved job error behind.
class AsyncsTest : public ::testing::Test {
 protected:
  void SetUp() override { asyncs::set_watchdog_timeout(std::chrono::seconds(10)); }
  void TearDown() override {
    EXPECT_NO_THROW(runtime::synchronize());
    asyncs::set_watchdog_timeout(std::chrono::milliseconds(0));
    asyncs::set_max_in_flight(1024);
  }
};

}  // namespace treetensor::testing
