// The tree layer's node allocator (treetensor/tree/node_allocator.hpp): freed children arrays
// are reused by the thread that frees them, the cache stays bounded, trees made on one thread
// and freed on another stay correct (this file runs under ThreadSanitizer too), and rebuilding
// a tree allocates no children array once the cache holds its arrays.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "treetensor/tree/tree.hpp"

// operator new of 64 bytes or more made by this thread; malloc and free underneath, with
// the matching deletes (AddressSanitizer checks that they match).
thread_local long large_news = 0;
void* operator new(std::size_t n) {
  if (n >= 64) ++large_news;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}

namespace {

namespace tr = treetensor::tree;
using tr::detail::BlockCache;
using tr::detail::NodeAllocator;
using IntTree = tr::Tree<int>;

// fanout^depth leaves numbered from `next`; a fifth of the leaf keys are longer than the 15
// characters std::string keeps inline (as tree_bench's).
IntTree make_tree(int fanout, int depth, int& next) {
  if (depth == 0) return next++;
  IntTree::Children children;
  for (int i = 0; i < fanout; ++i)
    children.emplace_back((depth == 1 ? (i % 5 == 4 ? "num_batches_tracked" : "weight") : "layer") +
                              std::to_string(i),
                          make_tree(fanout, depth - 1, next));
  return IntTree::from_children(std::move(children));
}

int leaf_sum(const IntTree& t) {
  int sum = 0;
  for (const int v : tr::flatten(t).leaves) sum += v;
  return sum;
}

TEST(NodeAllocator, AFreedArrayIsReusedForARequestOfItsSizeClass) {
  NodeAllocator<int> a;
  int* p = a.allocate(100);  // 400 bytes: the 512-byte class
  a.deallocate(p, 100);
  int* q = a.allocate(90);  // 360 bytes: the same class
  EXPECT_EQ(q == p, tr::detail::kCacheNodes);
  a.deallocate(q, 90);
  int* big = a.allocate(BlockCache::kLargestCached);  // beyond the cached sizes: operator new
  big[0] = 1;
  a.deallocate(big, BlockCache::kLargestCached);
}

// Freed arrays of several sizes, more than the cache may hold: it keeps at most its bound and
// at most kClassBytes of one size, and a full cache makes room for the size freed now.
TEST(NodeAllocator, TheCacheHoldsAtMostItsBoundsAndMakesRoomForTheSizeInUse) {
  NodeAllocator<char> a;
  BlockCache* cache = BlockCache::mine();
  ASSERT_NE(cache, nullptr);
  auto flood = [&](std::size_t block, std::size_t bytes) {
    std::vector<char*> blocks;
    for (std::size_t i = 0; i < bytes / block; ++i) blocks.push_back(a.allocate(block));
    for (char* p : blocks) a.deallocate(p, block);
  };
  const std::size_t before = cache->held();
  flood(std::size_t{64} << 10, 2 * BlockCache::kClassBytes);
  EXPECT_LE(cache->held() - before, BlockCache::kClassBytes);
  for (std::size_t block = 4096; block <= (std::size_t{512} << 10); block *= 2)
    flood(block, 2 * BlockCache::kClassBytes);
  EXPECT_LE(cache->held(), BlockCache::kCacheBytes);
  if (!tr::detail::kCacheNodes) return;
  EXPECT_GE(cache->held(), BlockCache::kCacheBytes - BlockCache::kClassBytes);
  char* small = a.allocate(100);  // the cache is full: a 128-byte array displaces a large one
  a.deallocate(small, 100);
  char* again = a.allocate(120);
  EXPECT_EQ(again, small);
  a.deallocate(again, 120);
  EXPECT_LE(cache->held(), BlockCache::kCacheBytes);
}

// Trees made on one thread are handed through a queue to another, read and freed there, for
// four threads doing both, 200 trees each; every tree keeps its values.
TEST(NodeAllocator, TreesMadeOnOneThreadAndFreedOnAnotherKeepTheirValues) {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<IntTree> queue;
  std::atomic<int> bad{0}, made{0};
  constexpr int kPerThread = 200;
  auto worker = [&](int seed) {
    for (int i = 0; i < kPerThread; ++i) {
      int next = seed * 1000 + i;
      IntTree t = make_tree(3 + i % 4, 2 + i % 2, next);
      const int want = leaf_sum(t);
      {
        std::lock_guard lock(mu);
        queue.push_back(IntTree::from_children({{"sum", want}, {"tree", std::move(t)}}));
      }
      cv.notify_one();
      ++made;
      IntTree got;
      {
        std::unique_lock lock(mu);
        if (!cv.wait_for(lock, std::chrono::seconds(60), [&] { return !queue.empty(); })) {
          ++bad;  // a watchdog: never a hang
          return;
        }
        got = std::move(queue.front());
        queue.pop_front();
      }
      if (leaf_sum(got["tree"]) != got["sum"].leaf()) ++bad;
    }
  };
  std::vector<std::thread> threads;
  for (int s = 0; s < 4; ++s) threads.emplace_back(worker, s);
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(made.load(), 4 * kPerThread);
}

// What removes the page faults: rebuilding a tree of a shape this thread has dropped before
// allocates no children array (glibc would hand freed ones back to the OS past its trim
// threshold: 66 page faults per rebuild of this tree in bench/tree_bench, none with the cache).
// Counted by this binary's operator new; the leaf keys longer than std::string's inline 15
// characters are smaller than the smallest children array (64 bytes) and not counted.
TEST(NodeAllocator, RebuildingATreeOfAShapeDroppedBeforeAllocatesNoChildrenArray) {
  if (!tr::detail::kCacheNodes) GTEST_SKIP() << "no cache under AddressSanitizer";
  int next = 0;
  const IntTree t = make_tree(17, 3, next);  // 5,220 nodes: 307 children arrays
  auto rebuild = [&] { return tr::map([](int v) { return v + 1; }, t); };
  rebuild();  // the cache fills
  for (int i = 0; i < 20; ++i) {
    const long before = large_news;
    IntTree out = tr::map([](int v) { return v + 1; }, t);
    EXPECT_EQ(large_news - before, 0) << "children arrays allocated in rebuild " << i;
    EXPECT_EQ(out.at(tr::Path{"layer16", "layer16", "weight16"}).leaf(), next);
  }
}

}  // namespace
