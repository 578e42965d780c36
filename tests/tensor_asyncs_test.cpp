// Tree-tensor ops respect asyncs operand tracking (DESIGN.md §10): an in-place tree op waits
// for pending work that reads its leaves (write-after-read), and a tree op reading leaves
// waits for pending work that writes them (read-after-write). Checked with values.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "tensor_test_util.hpp"
#include "treetensor/asyncs/thread.hpp"
#include "treetensor/tensor/tensor.hpp"

namespace tt = treetensor;
namespace asyncs = treetensor::asyncs;
using namespace tt_test;
using namespace std::chrono_literals;
using tt::TreeTensor;

TEST(TensorAsyncs, InPlaceTreeOpWaitsForPendingReader) {
  TreeTensor t{{"a", at::zeros({4})}, {"b", TensorTree{{"x", at::zeros({2, 2})}}}};
  const auto l = leaves(t);
  asyncs::Thread reader("reader");
  auto seen = reader.submit(
      [l] {
        std::this_thread::sleep_for(100ms);  // the main thread's add_ must not overtake this
        return (l[0].sum() + l[1].sum()).item<float>();
      },
      l, {}, "slow reader");
  t += 1;  // waits for the reader (its leaves are the reader's operands)
  EXPECT_EQ(seen.get(), 0.0f) << "the reader saw the update: the in-place op did not wait";
  EXPECT_EQ(tt::sum(t).item<float>(), 8.0f);
}

TEST(TensorAsyncs, TreeReadWaitsForPendingWriter) {
  TreeTensor t{{"a", at::zeros({3})}, {"b", at::zeros({3})}};
  const auto l = leaves(t);
  asyncs::Thread writer("writer");
  auto done = writer.submit(
      [l] {
        std::this_thread::sleep_for(100ms);
        for (const auto& x : l) x.fill_(5);
      },
      {}, l, "slow writer");
  const TreeTensor u = t * 2;  // a read of the written leaves: waits for the writer
  EXPECT_TRUE(at::equal(u.at("a").leaf(), at::full({3}, 10.0f)));
  EXPECT_TRUE(at::equal(u.at("b").leaf(), at::full({3}, 10.0f)));
  done.get();
}

TEST(TensorAsyncs, TreeCallsInsideAScopeRunOnTheAsyncsThread) {
  at::manual_seed(0);
  TreeTensor a = randn_tree({{"a", {3}}, {"b", {2, 2}}});
  asyncs::Thread worker("scope");
  TreeTensor r;
  {
    asyncs::ThreadScope scope(worker);
    r = a * 3 + 1;
  }
  expect_same(r, native([](auto& x) { return x * 3 + 1; }, a));
}

// treetensor::submit registers every leaf of its operand trees (Thread::submit took flat
// tensor lists only).
TEST(TensorAsyncs, SubmitWithTreesOfOperands) {
  TreeTensor t{{"a", at::zeros({3})}, {"b", TensorTree{{"c", at::zeros({2})}}}};
  asyncs::Thread writer("tree writer");
  auto done = tt::submit(
      writer,
      [t] {
        std::this_thread::sleep_for(100ms);
        for (const auto& x : leaves(t)) x.fill_(5);
      },
      TreeTensor(), t, "slow tree writer");
  const TreeTensor u = t * 2;  // reads the written leaves: waits for the writer
  EXPECT_TRUE(at::equal(u.at("a").leaf(), at::full({3}, 10.0f)));
  EXPECT_TRUE(at::equal(u.at("b.c").leaf(), at::full({2}, 10.0f)));
  done.get();

  asyncs::Thread reader("tree reader");
  auto seen = tt::submit(
      reader,
      [t] {
        std::this_thread::sleep_for(100ms);  // the add_ below must not overtake this
        return tt::sum(t).item<float>();
      },
      t);
  t += 1;  // writes the read leaves: waits for the reader
  EXPECT_EQ(seen.get(), 25.0f) << "the reader saw the update: the in-place op did not wait";
  EXPECT_EQ(tt::sum(t).item<float>(), 30.0f);
}
