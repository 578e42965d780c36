// The opt-in caching CPU allocator (issue 4, effect (2)). It is process-wide, so it has its
// own test program.
#include "runtime_test_util.hpp"
#include "treetensor/runtime/cpu_allocator.hpp"
#include "treetensor/runtime/stream.hpp"
#include "treetensor/tensor/rounding.hpp"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace rt = treetensor::runtime;
using namespace std::chrono_literals;

TEST(CachingCpuAllocator, ReusesFreedBlocksKeepsValuesAndHonoursTheCap) {
  at::manual_seed(0);
  const at::Tensor before = at::arange(100000, at::kFloat);  // allocated by the default allocator
  EXPECT_FALSE(rt::caching_cpu_allocator_installed());
  EXPECT_EQ(rt::caching_cpu_allocator_stats().hits, 0u);
  rt::use_caching_cpu_allocator();
  ASSERT_TRUE(rt::caching_cpu_allocator_installed());

  void* first = nullptr;
  {
    at::Tensor t = at::empty({256 * 1024}, at::kFloat);  // 1 MiB: cached
    first = t.data_ptr();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(first) % 64, 0u);
  }
  const auto after_free = rt::caching_cpu_allocator_stats();
  EXPECT_GE(after_free.cached_bytes, std::size_t{1} << 20);
  {
    at::Tensor again = at::empty({256 * 1024}, at::kFloat);
    EXPECT_EQ(again.data_ptr(), first) << "a freed block of the same size is handed out again";
    EXPECT_EQ(rt::caching_cpu_allocator_stats().hits, after_free.hits + 1);
  }
  // Small blocks are left to the previous allocator.
  const auto small_before = rt::caching_cpu_allocator_stats();
  { at::Tensor small = at::empty({100}, at::kFloat); }
  EXPECT_EQ(rt::caching_cpu_allocator_stats().misses, small_before.misses);
  EXPECT_EQ(rt::caching_cpu_allocator_stats().hits, small_before.hits);

  // Values under lanes, against the hand-written loop.
  std::vector<at::Tensor> a, b, expected, got(100);
  for (int i = 0; i < 100; ++i) {
    a.push_back(at::randn({64, 128}));
    b.push_back(at::randn({128, 256}));
    expected.push_back(at::matmul(a.back(), b.back()));
  }
  rt_test::with_watchdog(30s, [&] {
    rt::StreamGuard guard(2);
    for (int rep = 0; rep < 3; ++rep)
      rt_test::run_leaves("matmul", 100, [&](std::size_t i) { got[i] = at::matmul(a[i], b[i]); });
  });
  // 64x128 @ 128x256 is above OpenBLAS's threading threshold: the caller's product may sum in
  // another order than a lane's single-threaded one, so the matmul rounding bound decides.
  for (int i = 0; i < 100; ++i) {
    const auto agreement = treetensor::rounding::compare_matmul(got[i], expected[i], a[i], b[i]);
    EXPECT_TRUE(agreement.holds()) << "leaf " << i << ": " << agreement.describe();
  }
  EXPECT_TRUE(at::equal(before, at::arange(100000, at::kFloat)));

  // Cap 0: nothing more is kept.
  rt::use_caching_cpu_allocator(0);
  const std::size_t cached = rt::caching_cpu_allocator_stats().cached_bytes;
  { at::Tensor t = at::empty({512 * 1024}, at::kFloat); }
  EXPECT_LE(rt::caching_cpu_allocator_stats().cached_bytes, cached);
  rt::use_caching_cpu_allocator();
}

TEST(CachingCpuAllocator, ConcurrentAllocationAndFree) {
  rt::use_caching_cpu_allocator();
  rt_test::with_watchdog(30s, [&] {
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([t] {
        for (int i = 0; i < 300; ++i) {
          const int64_t n = 16384 * (1 + (i + t) % 5);  // 64 KiB .. 320 KiB
          at::Tensor x = at::full({n}, static_cast<float>(t));
          ASSERT_EQ(x.sum().item<float>(), static_cast<float>(t * n));
        }
      });
    for (auto& th : threads) th.join();
  });
  EXPECT_GT(rt::caching_cpu_allocator_stats().hits, 0u);
}
