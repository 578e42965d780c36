// Deferred trees (core.hpp, DESIGN.md §12): made once on first access, the source kept as a
// property of the value until a mutation. Also run under ThreadSanitizer (concurrent makes).
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "treetensor/tree/tree.hpp"

namespace {

using treetensor::tree::Path;
using treetensor::tree::Tree;

// Makes {a: base, b: {c: base + 1, d: base + 2}} and counts how often it was asked to.
class CountingSource : public Tree<int>::Source {
 public:
  explicit CountingSource(int base) : base_(base) {}
  Tree<int> make() const override {
    ++made;
    return {{"a", base_}, {"b", {{"c", base_ + 1}, {"d", base_ + 2}}}};
  }
  mutable std::atomic<int> made{0};

 private:
  int base_;
};

const Tree<int> kExpected = {{"a", 10}, {"b", {{"c", 11}, {"d", 12}}}};

TEST(TreeDeferred, MadeOnFirstAccessOnlyOnce) {
  auto src = std::make_shared<CountingSource>(10);
  const Tree<int> t = Tree<int>::deferred(src);
  EXPECT_EQ(src->made, 0);
  EXPECT_TRUE(t.is_deferred());
  EXPECT_EQ(t.source(), src.get());
  EXPECT_EQ(t.leaf_count(), 3u);
  EXPECT_EQ(src->made, 1);
  EXPECT_FALSE(t.is_deferred());
  EXPECT_EQ(t, kExpected);
  EXPECT_EQ(t.at("b.d").leaf(), 12);
  EXPECT_EQ(t.paths(), (std::vector<Path>{Path{"a"}, Path{"b", "c"}, Path{"b", "d"}}));
  EXPECT_EQ(src->made, 1);
  EXPECT_EQ(t.source(), src.get());  // const use keeps the property
}

TEST(TreeDeferred, CopiesCarryTheSourceAndMakeTheirOwn) {
  auto src = std::make_shared<CountingSource>(10);
  const Tree<int> t = Tree<int>::deferred(src);
  Tree<int> u = t;  // copied before made: the copy makes its own
  EXPECT_TRUE(u.is_deferred());
  EXPECT_EQ(u.source(), src.get());
  EXPECT_EQ(u, kExpected);
  EXPECT_EQ(src->made, 1);
  EXPECT_TRUE(t.is_deferred());
  EXPECT_EQ(t.depth(), 2u);
  EXPECT_EQ(src->made, 2);
  Tree<int> w = t;  // copied after made: the content is copied, not made again
  EXPECT_FALSE(w.is_deferred());
  EXPECT_EQ(w, kExpected);
  EXPECT_EQ(src->made, 2);
  Tree<int> moved = std::move(w);
  EXPECT_EQ(moved.source(), src.get());
  EXPECT_EQ(moved, kExpected);
}

TEST(TreeDeferred, MutationDropsTheSourceAndKeepsTheValues) {
  auto src = std::make_shared<CountingSource>(10);
  Tree<int> t = Tree<int>::deferred(src);
  t["b"]["c"].leaf() = 99;
  EXPECT_EQ(t.source(), nullptr);
  EXPECT_EQ(t.at("b.c").leaf(), 99);
  EXPECT_EQ(t.at("a").leaf(), 10);

  Tree<int> i = Tree<int>::deferred(src);
  i.insert("b.e", 5);
  EXPECT_EQ(i.source(), nullptr);
  EXPECT_EQ(i.leaf_count(), 4u);

  Tree<int> e = Tree<int>::deferred(src);
  EXPECT_TRUE(e.erase("b.c"));
  EXPECT_EQ(e.source(), nullptr);
  EXPECT_EQ(e, (Tree<int>{{"a", 10}, {"b", {{"d", 12}}}}));

  Tree<int> c = Tree<int>::deferred(src);
  c.children();  // a non-const accessor may mutate: the tag goes
  EXPECT_EQ(c.source(), nullptr);

  Tree<int> a = Tree<int>::deferred(src);
  a = Tree<int>(3);
  EXPECT_EQ(a.source(), nullptr);
  EXPECT_EQ(a.leaf(), 3);
}

TEST(TreeDeferred, DeferredSubtreeInsideAPlainTree) {
  auto src = std::make_shared<CountingSource>(1);
  Tree<int> outer = {{"x", Tree<int>::deferred(src)}, {"y", 7}};
  EXPECT_EQ(src->made, 0);
  EXPECT_EQ(outer.leaf_count(), 4u);
  EXPECT_EQ(outer.at("x.b.d").leaf(), 3);
  EXPECT_EQ(outer.paths().size(), 4u);
  EXPECT_EQ(src->made, 1);
}

TEST(TreeDeferred, TaggedKeepsTheValueAndTheSource) {
  auto src = std::make_shared<CountingSource>(10);
  const Tree<int> t = Tree<int>::tagged(kExpected, src);
  EXPECT_FALSE(t.is_deferred());
  EXPECT_EQ(t.source(), src.get());
  EXPECT_EQ(t, kExpected);
  EXPECT_EQ(src->made, 0);
}

TEST(TreeDeferred, ConcurrentFirstAccessMakesOnce) {
  for (int round = 0; round < 200; ++round) {
    auto src = std::make_shared<CountingSource>(round);
    const Tree<int> t = Tree<int>::deferred(src);
    std::vector<std::thread> threads;
    std::atomic<int> wrong{0};
    for (int k = 0; k < 4; ++k)
      threads.emplace_back([&, k] {
        const Tree<int> copy = t;  // copying races with making: never half-made
        const int v = k % 2 ? t.at("b.c").leaf() : copy.at("b.c").leaf();
        if (v != round + 1 || t.leaf_count() != 3) ++wrong;
      });
    for (auto& th : threads) th.join();
    EXPECT_EQ(wrong, 0);
    EXPECT_EQ(t.at("b.d").leaf(), round + 2);
  }
}

// A source that fails `failures` times, then makes kExpected; pending when asked.
class FlakySource : public Tree<int>::Source {
 public:
  FlakySource(int failures, bool pending, std::shared_ptr<const Source> property = nullptr)
      : failures_(failures), pending_(pending), property_(std::move(property)) {}
  Tree<int> make() const override {
    if (calls++ < failures_) throw std::runtime_error("not yet");
    return property_ ? Tree<int>::tagged(kExpected, property_) : kExpected;
  }
  bool pending() const noexcept override { return pending_; }
  mutable std::atomic<int> calls{0};

 private:
  int failures_;
  bool pending_;
  std::shared_ptr<const Source> property_;
};

TEST(TreeDeferred, AThrowingMakeLeavesTheTreeDeferredAndTheNextAccessTriesAgain) {
  auto src = std::make_shared<FlakySource>(2, false);
  const Tree<int> t = Tree<int>::deferred(src);
  EXPECT_THROW((void)t.size(), std::runtime_error);
  EXPECT_TRUE(t.is_deferred());
  // Concurrent accesses after a throw must not hang (std::call_once would, in libstdc++).
  std::atomic<int> thrown{0};
  std::thread other([&] {
    try {
      (void)t.is_leaf();
    } catch (const std::runtime_error&) {
      ++thrown;
    }
  });
  other.join();
  EXPECT_EQ(thrown, 1);
  EXPECT_EQ(t, kExpected);
  EXPECT_EQ(src->calls, 3);
}

TEST(TreeDeferred, APendingTreeTakesTheMadeTreesPropertyInsteadOfItsSource) {
  auto property = std::make_shared<CountingSource>(0);
  auto src = std::make_shared<FlakySource>(0, true, property);
  const Tree<int> t = Tree<int>::deferred(src);
  EXPECT_TRUE(t.is_pending());
  const Tree<int> copy = t;  // a pending copy makes its own
  EXPECT_EQ(t.source(), property.get()) << "source() makes a pending tree first";
  EXPECT_FALSE(t.is_pending());
  EXPECT_EQ(t, kExpected);
  EXPECT_TRUE(copy.is_pending());
  const Tree<int> made_copy = t;
  EXPECT_EQ(made_copy.source(), property.get()) << "copies carry the adopted property";
  EXPECT_EQ(copy.source(), property.get());
  EXPECT_EQ(src->calls, 2);
  const Tree<int> plain = Tree<int>::deferred(std::make_shared<FlakySource>(0, true));
  EXPECT_EQ(plain.source(), nullptr) << "a made tree without a property leaves none";
}

}  // namespace
