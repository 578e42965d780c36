// Operand tracking (OneFlow's const/mutable operand rule) checked with values.
#include "asyncs_test_util.hpp"

#include "treetensor/asyncs/operands.hpp"

#include <ATen/ATen.h>

#include <thread>

namespace asyncs = treetensor::asyncs;
using treetensor::testing::AsyncsTest;
using treetensor::testing::Gate;
using namespace std::chrono_literals;

namespace {

using AsyncsOperands = AsyncsTest;

bool all_equal(const at::Tensor& t, double v) {
  return at::equal(t, at::full_like(t, v));
}

// A slow reader on an asyncs thread, an in-place add_ on the main thread: the reader sees the
// old value, the main thread the new one.
TEST_F(AsyncsOperands, InPlaceUpdateWaitsForAPendingReader) {
  asyncs::Thread t;
  at::Tensor x = at::full({64}, 1.0);
  auto reader = t.submit(
      [x] {
        std::this_thread::sleep_for(50ms);
        return x.clone();
      },
      {x}, {});
  EXPECT_TRUE(asyncs::tracking_active());
  asyncs::await_operands({x}, {x});  // what the tensor layer does before x.add_(1)
  EXPECT_TRUE(reader.ready()) << "write-after-read must wait for the reader";
  x.add_(1);
  EXPECT_TRUE(all_equal(reader.get(), 1.0));
  EXPECT_TRUE(all_equal(x, 2.0));
  EXPECT_FALSE(asyncs::tracking_active()) << "nothing pending any more";
}

TEST_F(AsyncsOperands, ReadWaitsForAPendingWriterThroughAView) {
  asyncs::Thread t;
  at::Tensor x = at::zeros({4, 4});
  auto writer = t.submit(
      [x] {
        std::this_thread::sleep_for(50ms);
        x.fill_(3.0);
      },
      {}, {x});
  const at::Tensor row = x[2];  // a view: same storage, different TensorImpl and offset
  asyncs::await_operands({row}, {});
  EXPECT_TRUE(writer.ready()) << "read-after-write must wait for the writer";
  EXPECT_TRUE(all_equal(row.clone(), 3.0));
}

TEST_F(AsyncsOperands, ReadsDoNotWaitForReadersNorUnrelatedTensors) {
  asyncs::Thread t;
  Gate gate;
  const at::Tensor x = at::ones({3});
  const at::Tensor y = at::ones({3});
  auto reader = t.submit(
      [x, wait = gate.waiter()] {
        wait();
        return x.sum().item<double>();
      },
      {x}, {});
  asyncs::await_operands({x}, {y});  // read-read and an unrelated write: no wait
  EXPECT_FALSE(reader.ready());
  gate.open();
  EXPECT_EQ(reader.get(), 3.0);
}

TEST_F(AsyncsOperands, JobsStartAfterConflictingJobsSubmittedEarlierElsewhere) {
  asyncs::Thread a;
  asyncs::Thread b;
  at::Tensor x = at::zeros({8});
  a.submit(
      [x] {
        std::this_thread::sleep_for(50ms);
        x.fill_(5.0);
      },
      {}, {x});
  auto reader = b.submit([x] { return x.clone(); }, {x}, {});  // RAW across threads
  auto writer = b.submit([x] { x.add_(1.0); }, {}, {x});
  EXPECT_TRUE(all_equal(reader.get(), 5.0));
  writer.get();
  asyncs::await_operands({x}, {});
  EXPECT_TRUE(all_equal(x, 6.0));
}

TEST_F(AsyncsOperands, AJobNeverWaitsForWorkQueuedBehindItOrSubmittedAfterIt) {
  asyncs::Thread a;
  asyncs::Thread b;
  Gate gate;
  Gate later_gate;
  at::Tensor x = at::zeros({2});
  auto first = a.submit(
      [x, wait = gate.waiter()] {
        wait();
        // Same thread, queued behind: waiting would self-deadlock. Other thread, submitted after
        // this job: it waits for this job, so waiting for it would deadlock too.
        asyncs::await_operands({x}, {x});
        x.add_(1.0);
        return x.clone();
      },
      {}, {});
  a.submit([x] { x.mul_(10.0); }, {}, {x});
  auto other = b.submit(
      [x, wait = later_gate.waiter()] {
        wait();
        return x.clone();
      },
      {x}, {});
  gate.open();
  EXPECT_TRUE(all_equal(first.get(), 1.0));
  later_gate.open();
  EXPECT_TRUE(all_equal(other.get(), 10.0)) << "the reader on b ran after the writer on a";
}

TEST_F(AsyncsOperands, AJobWaitsForWorkItSubmittedElsewhere) {
  asyncs::Thread a;
  asyncs::Thread b;
  at::Tensor x = at::zeros({2});
  auto parent = a.submit([&b, x] {
    b.submit(
        [x] {
          std::this_thread::sleep_for(30ms);
          x.fill_(7.0);
        },
        {}, {x});
    asyncs::await_operands({x}, {});
    return x.clone();
  });
  EXPECT_TRUE(all_equal(parent.get(), 7.0));
}

TEST_F(AsyncsOperands, AwaitOperandsHasAWatchdog) {
  asyncs::set_watchdog_timeout(50ms);
  asyncs::Thread t;
  Gate gate;
  const at::Tensor x = at::zeros({1});
  t.submit(gate.waiter(), {}, {x}, "stuck writer");
  try {
    asyncs::await_operands({x}, {});
    FAIL() << "the watchdog must fire";
  } catch (const asyncs::WatchdogTimeout& e) {
    EXPECT_TRUE(treetensor::testing::contains(e.what(), "await_operands"));
    EXPECT_TRUE(treetensor::testing::contains(e.what(), "'stuck writer' running"));
  }
  gate.open();
}

}  // namespace
