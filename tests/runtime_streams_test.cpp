// The lane stream protocol (DESIGN.md §7) on a simulated-stream backend: every "stream" is a
// host thread running its queue in order, a marker completes when its stream reaches it. Leaf
// work is enqueued on the current stream and runs asynchronously, as on a GPU. With every wait
// the values are right; switching off either wait makes them wrong.
#include "runtime/fork.hpp"
#include "runtime/lanes.hpp"
#include "runtime_test_util.hpp"
#include "treetensor/runtime/device_streams.hpp"
#include "treetensor/runtime/stream.hpp"

#include <c10/core/Allocator.h>
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace rt = treetensor::runtime;
using namespace std::chrono_literals;
using rt_test::run_leaves;
using rt_test::with_watchdog;

namespace {

// One simulated stream: a host thread that runs enqueued work in order.
class SimStream {
 public:
  SimStream() : thread_([this] { loop(); }) {}
  ~SimStream() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void enqueue(std::function<void()> work) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(work));
    }
    cv_.notify_all();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> work;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      work();
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

struct SimMarker final : rt::StreamBackend::Marker {
  std::mutex mutex;
  std::condition_variable cv;
  bool complete = false;
  void set() {
    {
      std::lock_guard lock(mutex);
      complete = true;
    }
    cv.notify_all();
  }
  void wait() {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return complete; });
  }
};

// Stream id 0 is every thread's default stream; lanes get ids 1, 2, ...
class SimBackend final : public rt::StreamBackend {
 public:
  c10::Stream current(c10::Device) override { return as_stream(current_id()); }
  c10::Stream exchange(c10::Stream s) override {
    const auto previous = current_id();
    current_id() = s.id();
    return as_stream(previous);
  }
  c10::Stream lane_stream(std::size_t lane, c10::Device) override {
    const auto id = static_cast<c10::StreamId>(lane);
    stream(id);  // create it
    return as_stream(id);
  }
  std::unique_ptr<Marker> record(const c10::Stream& s) override {
    auto marker = std::make_shared<SimMarker>();
    stream(s.id()).enqueue([marker] { marker->set(); });
    return std::make_unique<Handle>(marker);
  }
  void wait(const c10::Stream& waiter, const Marker& m) override {
    auto marker = static_cast<const Handle&>(m).marker;
    stream(waiter.id()).enqueue([marker] { marker->wait(); });
  }
  void record_data_ptr(const c10::DataPtr& data, const c10::Stream& s) override {
    std::lock_guard lock(mutex_);
    recorded_.emplace_back(data.get(), s.id());
  }
  void synchronize_lanes() override {
    std::vector<c10::StreamId> ids;
    {
      std::lock_guard lock(mutex_);
      for (const auto& entry : streams_) ids.push_back(entry.first);
    }
    for (auto id : ids) synchronize(id);
  }

  // Test side.
  void enqueue_current(std::function<void()> work) {
    stream(current_id()).enqueue(std::move(work));
  }
  void synchronize(c10::StreamId id) {
    auto marker = record(as_stream(id));
    static_cast<Handle&>(*marker).marker->wait();
  }
  std::vector<std::pair<void*, c10::StreamId>> recorded() {
    std::lock_guard lock(mutex_);
    return recorded_;
  }
  static c10::StreamId& current_id() {
    thread_local c10::StreamId id = 0;
    return id;
  }

 private:
  struct Handle final : Marker {
    explicit Handle(std::shared_ptr<SimMarker> m) : marker(std::move(m)) {}
    std::shared_ptr<SimMarker> marker;
  };
  static c10::Stream as_stream(c10::StreamId id) {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCPU), id);
  }
  SimStream& stream(c10::StreamId id) {
    std::lock_guard lock(mutex_);
    auto& slot = streams_[id];
    if (!slot) slot = std::make_unique<SimStream>();
    return *slot;
  }
  std::mutex mutex_;
  std::map<c10::StreamId, std::unique_ptr<SimStream>> streams_;
  std::vector<std::pair<void*, c10::StreamId>> recorded_;
};

constexpr int kLeaves = 16;

struct Outcome {
  int wrong = 0;            // leaves whose final value is not 2·(i+1)
  int on_lane_streams = 0;  // leaves whose work was enqueued on a lane stream
};

// Caller stream: waits for a host gate, then writes x; lanes: y = 2x on the current stream
// (reading x at once, writing y 20 ms later); caller stream again: z = y. The gate opens only after
// the host has enqueued everything, so no ordering comes from host timing. The host then waits for
// the caller stream only.
Outcome run_protocol(std::size_t lanes, rt::testing::ProtocolWaits waits) {
  auto sim = std::make_shared<SimBackend>();
  rt::testing::install_stream_backend(sim, waits);
  std::vector<std::atomic<int>> x(kLeaves), y(kLeaves), z(kLeaves);
  std::atomic<int> on_lanes{0};
  SimMarker gate;
  sim->enqueue_current([&] {
    gate.wait();
    for (int i = 0; i < kLeaves; ++i) x[i].store(i + 1);
  });
  {
    rt::StreamGuard guard(lanes);
    run_leaves("double", kLeaves, [&](std::size_t i) {
      const bool on_lane = SimBackend::current_id() != 0;
      on_lanes += on_lane;
      std::this_thread::sleep_for(200us);  // host-side work, so workers take part
      // On a loaded machine (TSan, tests in parallel) the workers may wake only after the
      // caller has run every leaf itself: the caller holds back (up to 2 s) until a worker has
      // taken a leaf, so that the protocol is exercised however slow the machine is.
      const auto until = std::chrono::steady_clock::now() + 2s;
      while (lanes > 1 && !on_lane && on_lanes.load() == 0 &&
             std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(100us);
      sim->enqueue_current([&, i, on_lane] {
        const int xi = x[i].load();
        // Lane kernels are slow (read early, write late); the caller's own share is quick so
        // that it cannot hide a missing wait by delaying the caller stream.
        if (on_lane) std::this_thread::sleep_for(20ms);
        y[i].store(2 * xi);
      });
    });
  }
  sim->enqueue_current([&] {
    for (int i = 0; i < kLeaves; ++i) z[i].store(y[i].load());
  });
  // Margins far above scheduling delays of a loaded machine: lane streams get 50 ms to read x
  // too early when they do not wait, and lane kernels write y 20 ms after reading x.
  std::this_thread::sleep_for(50ms);
  gate.set();
  sim->synchronize(0);
  sim->synchronize_lanes();  // before x, y, z go away
  rt::testing::install_stream_backend(nullptr);
  Outcome out;
  for (int i = 0; i < kLeaves; ++i) out.wrong += z[i].load() != 2 * (i + 1);
  out.on_lane_streams = on_lanes.load();
  return out;
}

class LaneStreams : public ::testing::TestWithParam<std::size_t> {};

}  // namespace

TEST_P(LaneStreams, AllWaitsGiveRightValuesWithoutUserSynchronize) {
  with_watchdog(30s, [&] {
    const Outcome out = run_protocol(GetParam(), {});
    EXPECT_EQ(out.wrong, 0);
    if (GetParam() > 1) {
      EXPECT_GT(out.on_lane_streams, 0) << "no leaf ran on a lane stream; the test proves nothing";
    }
  });
}

TEST_P(LaneStreams, WithoutLaneWaitingForCallerValuesAreWrong) {
  if (GetParam() == 1) {
    GTEST_SKIP() << "linear calls use no lane streams";
  }
  with_watchdog(30s, [&] {
    const Outcome out = run_protocol(GetParam(), {.lane_waits_for_caller = false});
    ASSERT_GT(out.on_lane_streams, 0);
    EXPECT_GT(out.wrong, 0) << "lanes read x before the caller stream wrote it";
  });
}

TEST_P(LaneStreams, WithoutCallerWaitingForLanesValuesAreWrong) {
  if (GetParam() == 1) {
    GTEST_SKIP() << "linear calls use no lane streams";
  }
  with_watchdog(30s, [&] {
    const Outcome out = run_protocol(GetParam(), {.caller_waits_for_lanes = false});
    ASSERT_GT(out.on_lane_streams, 0);
    EXPECT_GT(out.wrong, 0) << "the caller stream read y before the lanes wrote it";
  });
}

TEST_P(LaneStreams, OutputsOfLaneLeavesAreRecordedOnTheCallerStream) {
  auto sim = std::make_shared<SimBackend>();
  rt::testing::install_stream_backend(sim);
  std::vector<int> storage(kLeaves);
  std::vector<c10::StreamId> ran_on(kLeaves, -1);
  with_watchdog(30s, [&] {
    rt::StreamGuard guard(GetParam());
    run_leaves("record", kLeaves, [&](std::size_t i) {
      std::this_thread::sleep_for(200us);
      ran_on[i] = SimBackend::current_id();
      rt::record_for_caller(c10::DataPtr(&storage[i], c10::Device(c10::kCPU)));
    });
  });
  sim->synchronize_lanes();
  rt::testing::install_stream_backend(nullptr);
  std::map<void*, c10::StreamId> recorded;
  for (const auto& [ptr, stream] : sim->recorded()) recorded[ptr] = stream;
  for (int i = 0; i < kLeaves; ++i) {
    if (ran_on[i] == 0) {
      EXPECT_EQ(recorded.count(&storage[i]), 0u) << "caller's own leaf " << i;
    } else {
      ASSERT_EQ(recorded.count(&storage[i]), 1u) << "lane leaf " << i;
      EXPECT_EQ(recorded[&storage[i]], 0) << "recorded on the caller's stream";
    }
  }
  // Outside run() it is a no-op.
  rt::record_for_caller(c10::DataPtr(&storage[0], c10::Device(c10::kCPU)));
  EXPECT_EQ(sim->recorded().size(), recorded.size());
}

INSTANTIATE_TEST_SUITE_P(LaneStreams, LaneStreams, ::testing::Values(1, 2, 4, 8),
                         [](const auto& info) { return "lanes" + std::to_string(info.param); });

TEST(LaneStreamsCpu, CpuCallsUseNoBackendAndSynchronizeIsANoOp) {
  std::atomic<int> n{0};
  rt::StreamGuard guard(2);
  run_leaves("cpu", 32, [&](std::size_t) { n.fetch_add(1); });
  rt::synchronize_lane_streams();
  EXPECT_EQ(n.load(), 32);
}

// DESIGN.md §10, "fork()": the lane stream registry's mutex and the others are held over fork()
// through hold_over_fork. The fork stress tests reach a fork inside such a section only by
// chance; here one is certain: another thread holds both a registered and a plain mutex when
// fork() is called. The fork waits for the registered one, which the child then finds free;
// the plain one the child inherits locked (what every registered mutex would do without it).
TEST(ForkMutexes, AMutexHeldOverForkIsFreeInTheChildWhereAPlainOneStaysLocked) {
  static std::mutex held;  // process-wide and never destroyed, as hold_over_fork requires
  static std::mutex plain;
  static const int registered = (rt::detail::hold_over_fork(held), 0);
  (void)registered;
  std::atomic<int> stage{0};
  std::thread other([&] {
    const std::lock_guard keep(plain);
    {
      const std::lock_guard briefly(held);
      stage.store(1);
      std::this_thread::sleep_for(100ms);  // fork() is called meanwhile and waits for `held`
    }
    while (stage.load() != 2) std::this_thread::sleep_for(1ms);  // `plain` held until forked
  });
  while (stage.load() != 1) std::this_thread::yield();
  const int status = rt_test::in_forked_child(20s, [] {
    const bool held_free = held.try_lock();
    const bool plain_free = plain.try_lock();
    return (held_free ? 0 : 1) + (plain_free ? 2 : 0);
  });
  stage.store(2);
  other.join();
  EXPECT_EQ(status, 0) << "1: the registered mutex was locked in the child; 2: the plain one was "
                          "free (the fork did not happen while it was held)";
}
