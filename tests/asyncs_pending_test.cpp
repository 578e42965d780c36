// Pending scopes (DESIGN.md §10; OneFlow parity): inside a pending asyncs::ThreadScope a tree
// call returns at once a pending tree and the caller goes on; every read path waits for
// exactly the job it needs; chains, in-place calls, errors, nesting and threads. Every value
// is checked against the hand-written loop over at:: calls. Runs under ThreadSanitizer too.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <random>
#include <sstream>
#include <thread>

#include "asyncs_test_util.hpp"
#include "tensor_test_util.hpp"
#include "treetensor/asyncs/thread.hpp"
#include "treetensor/tensor/tensor.hpp"

namespace tt = treetensor;
namespace asyncs = treetensor::asyncs;
namespace rt = treetensor::runtime;
using namespace tt_test;
using namespace std::chrono_literals;
using treetensor::testing::AsyncsTest;
using treetensor::testing::contains;
using treetensor::testing::Gate;
using tt::TreeTensor;

namespace {

TreeTensor sample(int seed = 0) {
  at::manual_seed(seed);
  return randn_tree({{"a", {3}}, {"b", {{"x", {2, 2}}, {"y", {4}}}}});
}

// Opens `gate` from another thread after `delay`, setting `opened` first: a read that returns
// with `opened` false did not wait for the gated job.
class LateOpener {
 public:
  LateOpener(Gate& gate, std::chrono::milliseconds delay)
      : thread_([this, &gate, delay] {
          std::this_thread::sleep_for(delay);
          opened_.store(true);
          gate.open();
        }) {}
  ~LateOpener() { thread_.join(); }
  bool opened() const { return opened_.load(); }

 private:
  std::atomic<bool> opened_{false};
  std::thread thread_;
};

class AsyncsPending : public AsyncsTest {};

}  // namespace

TEST_F(AsyncsPending, ATreeCallReturnsAtOnceAndItsReadWaitsForTheJob) {
  const TreeTensor x = sample();
  asyncs::Thread worker("pending");
  Gate gate;
  worker.submit(gate.waiter(), {}, {}, "gate");
  TreeTensor r;
  {
    asyncs::ThreadScope scope(worker);
    r = x * 2 + 1;  // two jobs queued behind the gate: the caller does not wait
  }
  EXPECT_TRUE(r.is_pending());
  EXPECT_EQ(worker.in_flight(), 3u) << "the gate and both calls are queued";
  const LateOpener opener(gate, 30ms);
  expect_same(r, native([](const at::Tensor& l) { return l * 2 + 1; }, x));
  EXPECT_TRUE(opener.opened()) << "the read returned before its job could run";
  EXPECT_FALSE(r.is_pending());
}

// Every way to look at a pending result waits for its job, and sees the values.
TEST_F(AsyncsPending, EveryReadPathWaits) {
  const TreeTensor x = sample(1);
  const TreeTensor want = native([](const at::Tensor& l) { return l.sigmoid(); }, x);
  asyncs::Thread worker("reads");
  asyncs::Thread other("other");
  const auto pending = [&](Gate& gate) {
    worker.submit(gate.waiter(), {}, {}, "gate");
    asyncs::ThreadScope scope(worker);
    return x.sigmoid();
  };
  const std::vector<std::pair<std::string, std::function<void(const TreeTensor&)>>> reads = {
      {"leaf",
       [&](const TreeTensor& r) {
         EXPECT_TRUE(at::equal(r.at("b.x").leaf(), want.at("b.x").leaf()));
       }},
      {"operator[]",
       [&](const TreeTensor& r) { EXPECT_TRUE(at::equal(r["a"].leaf(), want["a"].leaf())); }},
      {"item",
       [&](const TreeTensor& r) {
         EXPECT_EQ(r["a"].leaf()[0].item<float>(), want["a"].leaf()[0].item<float>());
       }},
      {"structure",
       [&](const TreeTensor& r) {
         EXPECT_EQ(r.size(), 2u);
         EXPECT_EQ(paths(r), paths(want));
       }},
      {"print",
       [&](const TreeTensor& r) {
         std::ostringstream a, b;
         a << r;
         b << want;
         EXPECT_EQ(a.str(), b.str());
       }},
      {"a copy",
       [&](const TreeTensor& r) {
         const TreeTensor c = r;  // copied pending: its own read waits
         expect_same(c, want);
       }},
      {"a tree call outside the scope", [&](const TreeTensor& r) { expect_same(r * 1, want); }},
      {"a tree-level reduction",
       [&](const TreeTensor& r) { EXPECT_TRUE(at::equal(tt::sum(r), tt::sum(want))); }},
      {"a tree call on another OS thread",
       [&](const TreeTensor& r) {
         TreeTensor got;
         std::thread t([&] { got = r + 0; });
         t.join();
         expect_same(got, want);
       }},
      {"a scoped call on another asyncs thread",
       [&](const TreeTensor& r) {
         TreeTensor got;
         {
           asyncs::ThreadScope scope(other);
           got = r + 0;
         }
         expect_same(got, want);
       }},
      {"a mutation",
       [&](const TreeTensor& r) {
         TreeTensor m = r;
         m.insert("c", at::ones({1}));
         EXPECT_TRUE(at::equal(m.at("a").leaf(), want.at("a").leaf()));
       }},
      {"synchronize",
       [&](const TreeTensor& r) {
         rt::synchronize();
         EXPECT_EQ(worker.in_flight(), 0u);
         expect_same(r, want);
       }},
  };
  for (const auto& [name, read] : reads) {
    SCOPED_TRACE(name);
    Gate gate;
    const TreeTensor r = pending(gate);
    ASSERT_TRUE(r.is_pending());
    const LateOpener opener(gate, 20ms);
    read(r);
    EXPECT_TRUE(opener.opened()) << "the read did not wait for the job";
  }
}

TEST_F(AsyncsPending, ACallChainsOnPendingResultsWithoutWaiting) {
  const TreeTensor x = sample(2), y = sample(3);
  asyncs::Thread worker("chain");
  Gate gate;
  worker.submit(gate.waiter(), {}, {}, "gate");
  TreeTensor r;
  {
    asyncs::ThreadScope scope(worker);
    TreeTensor s = tt::add(x, y, 0.5);
    TreeTensor m = tt::mul(s, x);
    r = tt::clamp(tt::matmul(m, m).sigmoid(), 0.1, 0.9);
  }
  EXPECT_EQ(worker.in_flight(), 6u) << "gate, add, mul, matmul, sigmoid, clamp: none waited";
  gate.open();
  expect_same(r, native(
                     [](const at::Tensor& a, const at::Tensor& b) {
                       const at::Tensor m = (a + b * 0.5) * a;
                       return at::clamp(at::matmul(m, m).sigmoid(), 0.1, 0.9);
                     },
                     x, y));
}

TEST_F(AsyncsPending, InPlaceCallsLeaveTheirTreePendingAndAReadWaits) {
  TreeTensor t = sample(4);
  const TreeTensor before = tt::clone(t);
  const at::Tensor a = t.at("a").leaf();  // a handle taken before: tracked, not deferred
  asyncs::Thread worker("in place");
  Gate gate;
  worker.submit(gate.waiter(), {}, {}, "gate");
  {
    asyncs::ThreadScope scope(worker);
    t.add_(1);
    t.mul_(2);
  }
  EXPECT_TRUE(t.is_pending());
  const LateOpener opener(gate, 20ms);
  const TreeTensor want = native([](const at::Tensor& l) { return (l + 1) * 2; }, before);
  // A tree call reading the handle waits for the pending writes (operand tracking).
  const TreeTensor only_a{{"a", a}};
  EXPECT_TRUE(at::equal((only_a * 1).at("a").leaf(), want.at("a").leaf()));
  EXPECT_TRUE(opener.opened());
  expect_same(t, want);
  EXPECT_TRUE(t.at("a").leaf().is_same(a)) << "in place: the same leaf tensors";
}

// A job that took a pending tree as its operand could not register that tree's leaves when it
// was submitted: they are registered when the tree is made, so a later in-place write of them
// still waits for the reader (write-after-read).
TEST_F(AsyncsPending, AWriteWaitsForAJobThatReadItsTreeWhilePending) {
  const TreeTensor x = sample(13);
  asyncs::Thread producer("producer"), reader("reader");
  Gate gate;
  reader.submit(gate.waiter(), {}, {}, "gate");
  TreeTensor y, z;
  {
    asyncs::ThreadScope scope(producer);
    y = x.sigmoid();
  }
  {
    asyncs::ThreadScope scope(reader);
    z = y * 2;  // queued behind the gate, reads y's leaves later
  }
  const LateOpener opener(gate, 30ms);
  y.add_(1);  // makes y (waits for the producer), then must wait for the reader
  EXPECT_TRUE(opener.opened()) << "the write did not wait for the pending reader";
  expect_same(z, native([](const at::Tensor& l) { return l.sigmoid() * 2; }, x));
  expect_same(y, native([](const at::Tensor& l) { return l.sigmoid() + 1; }, x));
}

// The same with the reader's operand an in-place target that has a pending subtree: its
// leaves are known only once the in-place job has run.
TEST_F(AsyncsPending, AWriteWaitsForAReaderOfATreeWithAPendingSubtree) {
  const TreeTensor x = sample(15);
  asyncs::Thread a("a"), b("b");
  Gate gate;
  b.submit(gate.waiter(), {}, {}, "gate");
  TreeTensor t, z;
  {
    asyncs::ThreadScope scope(a);
    const TreeTensor p = x.sigmoid();  // pending
    t = TensorTree::from_children({{"p", p}, {"q", TensorTree(at::ones({3}))}});
    t.add_(1);  // its target has a pending node: leaves known once it has run
  }
  {
    asyncs::ThreadScope scope(b);
    z = t * 2;  // queued behind the gate
  }
  TreeTensor u = t;
  const LateOpener opener(gate, 30ms);
  u.mul_(10);  // must wait for the reader z
  EXPECT_TRUE(opener.opened()) << "the write did not wait for the pending reader";
  expect_same(z["p"], native([](const at::Tensor& l) { return (l.sigmoid() + 1) * 2; }, x));
  EXPECT_TRUE(at::equal(z.at("q").leaf(), at::full({3}, 4.0f)));
}

// A failed in-place call's error is raised by the first read of its target; afterwards the
// tree is what the call left, as without a scope.
TEST_F(AsyncsPending, AFailedInPlaceCallRaisesOnceThenLeavesItsTreeUsable) {
  TreeTensor t = sample(16);
  const TreeTensor before = tt::clone(t);
  const TreeTensor bad{{"a", at::ones({2})},
                       {"b", TensorTree{{"x", at::ones({2, 2})}, {"y", at::ones({4})}}}};
  asyncs::Thread worker("in-place error");
  {
    asyncs::ThreadScope scope(worker);
    t.add_(bad);  // leaf 'a': [3] += [2] fails
  }
  try {
    (void)t.size();
    FAIL() << "the first read must raise the error";
  } catch (const std::exception& e) {
    EXPECT_TRUE(contains(e.what(), "'tree call add_'"));
    EXPECT_TRUE(contains(e.what(), "updated 2 of 3 leaves")) << "as without a scope";
  }
  EXPECT_TRUE(at::equal(t.at("a").leaf(), before.at("a").leaf())) << "'a' was not updated";
  EXPECT_TRUE(at::equal(t.at("b.y").leaf(), before.at("b.y").leaf() + 1));
  EXPECT_NO_THROW(rt::synchronize());
}

TEST_F(AsyncsPending, AnErrorMidChainIsRaisedAtTheFirstReadWithItsContext) {
  const TreeTensor x = sample(5);
  const TreeTensor bad{{"a", at::ones({2, 3})},
                       {"b", TensorTree{{"x", at::ones({5, 5})}, {"y", at::ones({4})}}}};
  asyncs::Thread worker("errors");
  TreeTensor y, z;
  {
    asyncs::ThreadScope scope(worker);
    y = tt::matmul(x, bad);  // leaf 'a': [3] @ [2, 3] fails on the worker
    z = y + 1;               // chained: fails with y's error as its cause
  }
  try {
    (void)z.size();
    FAIL() << "reading a failed chain must throw";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_TRUE(contains(what, "asyncs thread " + std::to_string(worker.id()) + ", job 2"));
    EXPECT_TRUE(contains(what, "'tree call add'"));
    EXPECT_TRUE(contains(what, "matmul"));
    EXPECT_TRUE(contains(what, "'a'"));
    EXPECT_TRUE(contains(what, "job 1 'tree call matmul'")) << "the cause is named";
  }
  EXPECT_THROW((void)y.at("a"), std::exception) << "every read of a failed result throws";
  EXPECT_THROW((void)z.size(), std::exception) << "and again: nothing half-made is handed out";
  EXPECT_TRUE(z.is_pending());
  EXPECT_NO_THROW(rt::synchronize()) << "both errors were observed by reads";
}

TEST_F(AsyncsPending, AnErrorNobodyReadIsRaisedBySynchronize) {
  const TreeTensor x = sample(6);
  asyncs::Thread worker("unread");
  {
    asyncs::ThreadScope scope(worker);
    (void)tt::view(x, {7});  // no leaf has 7 elements; the result is dropped unread
  }
  try {
    rt::synchronize();
    FAIL() << "synchronize must report the unread error";
  } catch (const std::exception& e) {
    EXPECT_TRUE(contains(e.what(), "'tree call view'"));
    EXPECT_TRUE(contains(e.what(), "view"));
  }
}

TEST_F(AsyncsPending, BlockingScopesRunTheCallAndWait) {
  const TreeTensor x = sample(7);
  asyncs::Thread worker("blocking");
  TreeTensor r;
  {
    asyncs::ThreadScope scope(worker, asyncs::ScopeMode::blocking);
    r = x.exp();
    EXPECT_FALSE(r.is_pending());
    EXPECT_THROW((void)tt::view(x, {7}), std::exception) << "the call itself throws";
  }
  expect_same(r, native([](const at::Tensor& l) { return l.exp(); }, x));
}

TEST_F(AsyncsPending, ScopesNestAndTheInnermostWins) {
  const TreeTensor x = sample(8);
  asyncs::Thread outer("outer"), inner("inner"), side("side");
  Gate a, b;
  outer.submit(a.waiter(), {}, {}, "gate a");
  inner.submit(b.waiter(), {}, {}, "gate b");
  TreeTensor r1, r2, r3;
  {
    asyncs::ThreadScope s1(outer);
    r1 = x + 1;
    {
      asyncs::ThreadScope s2(inner);
      r2 = r1 * 2;  // on inner: waits there for r1's job on outer
      {
        asyncs::ThreadScope s3(side, asyncs::ScopeMode::blocking);
        EXPECT_FALSE((x - 1).is_pending()) << "a blocking scope inside a pending one";
      }
    }
    r3 = r2 - 3;  // back on outer, after r1
  }
  EXPECT_EQ(outer.in_flight(), 3u);
  a.open();
  b.open();
  expect_same(r3, native([](const at::Tensor& l) { return (l + 1) * 2 - 3; }, x));
}

TEST_F(AsyncsPending, TwoOSThreadsEachInTheirOwnScope) {
  std::vector<TreeTensor> inputs{sample(9), sample(10)};
  std::vector<TreeTensor> got(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i)
    threads.emplace_back([&, i] {
      asyncs::Thread worker("thread " + std::to_string(i));
      {
        asyncs::ThreadScope scope(worker);
        TreeTensor t = inputs[i] * (i + 2);
        t.sub_(1);
        got[i] = t.abs().sqrt();
      }
      (void)got[i].size();  // read before the worker's Thread goes
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < 2; ++i)
    expect_same(got[i], native([i](const at::Tensor& l) { return (l * (i + 2) - 1).abs().sqrt(); },
                               inputs[i]));
}

TEST_F(AsyncsPending, ConsolidatedTreesStayConsolidatedThroughAPendingCall) {
  const TreeTensor x = tt::consolidate(sample(11));
  asyncs::Thread worker("flat");
  TreeTensor r;
  {
    asyncs::ThreadScope scope(worker);
    r = x * 3;
  }
  EXPECT_TRUE(tt::is_consolidated(r)) << "the made tree keeps the flat call's property";
  expect_same(r, native([](const at::Tensor& l) { return l * 3; }, x));
}

TEST_F(AsyncsPending, ADroppedPendingResultStillRunsAndLeavesNothingBehind) {
  TreeTensor x = sample(12);
  asyncs::Thread worker("dropped");
  {
    asyncs::ThreadScope scope(worker);
    (void)(x * 2);
  }
  x.add_(1);  // a write of the dropped call's operand waits for it (tracking)
  rt::synchronize();
  EXPECT_EQ(worker.in_flight(), 0u);
}

// Every op that goes pending, inside a pending scope, against the same call without one. The
// arguments are temporaries that die when the op returns, so a leaf function that kept a
// reference to one (instead of a copy) reads freed memory here (AddressSanitizer's run).
TEST_F(AsyncsPending, EveryPendingOpEqualsTheSameCallWithoutAScope) {
  at::manual_seed(14);
  const TreeTensor x = randn_tree({{"a", {4, 6}}, {"b", {{"c", {4, 6}}}}});
  const TreeTensor y = randn_tree({{"a", {4, 6}}, {"b", {{"c", {4, 6}}}}});
  const TreeTensor m = x.gt(0);
  using Op = std::function<TreeTensor()>;
  const std::vector<std::pair<std::string, Op>> ops = {
      {"add alpha", [&] { return tt::add(x, y, at::Scalar(0.5 + 0.25)); }},
      {"sub_",
       [&] {
         TreeTensor t = tt::clone(x);
         return tt::sub_(t, y, at::Scalar(2));
       }},
      {"binary table", [&] { return tt::div(tt::mul(x, y), tt::Operand(1.5)); }},
      {"unary_",
       [&] {
         TreeTensor t = tt::clone(x);
         return tt::tanh_(t);
       }},
      {"clamp", [&] { return tt::clamp(x, at::Scalar(-0.5), at::Scalar(0.5)); }},
      {"clamp_",
       [&] {
         TreeTensor t = tt::clone(x);
         return tt::clamp_(t, at::Scalar(-0.1), c10::nullopt);
       }},
      {"matmul", [&] { return tt::matmul(x, tt::transpose(y, 0, 1)); }},
      {"addcmul", [&] { return tt::addcmul(x, y, x, at::Scalar(0.3)); }},
      {"addcdiv_",
       [&] {
         TreeTensor t = tt::clone(x);
         return tt::addcdiv_(t, y, tt::exp(x), at::Scalar(0.7));
       }},
      {"lerp", [&] { return tt::lerp(x, y, at::Scalar(0.25)); }},
      {"lerp_",
       [&] {
         TreeTensor t = tt::clone(x);
         return tt::lerp_(t, y, at::Scalar(0.75));
       }},
      {"where", [&] { return tt::where(m, x, y); }},
      {"copy_",
       [&] {
         TreeTensor t = tt::clone(x);
         return tt::copy_(t, y);
       }},
      {"zero_",
       [&] {
         TreeTensor t = tt::clone(x);
         return tt::zero_(t);
       }},
      {"fill_",
       [&] {
         TreeTensor t = tt::clone(x);
         return tt::fill_(t, at::Scalar(3.5));
       }},
      {"isclose", [&] { return tt::isclose(x, y, 0.5 + 0.5, 0.25); }},
      {"to", [&] { return tt::to(x, at::kDouble); }},
      {"reshape",
       [&] {
         return tt::reshape(x, std::vector<int64_t>{6, 4});
       }},
      {"view",
       [&] {
         return tt::view(x, std::vector<int64_t>{2, 12});
       }},
      {"permute",
       [&] {
         return tt::permute(x, std::vector<int64_t>{1, 0});
       }},
      {"flatten", [&] { return tt::flatten(x, 0, 1); }},
      {"unsqueeze", [&] { return tt::squeeze(tt::unsqueeze(x, 1), 1); }},
      {"index_select", [&] { return tt::index_select(x, 1, at::arange(0, 6, 2)); }},
      {"cat",
       [&] {
         return tt::cat({x, y}, 1);
       }},
      {"stack",
       [&] {
         return tt::stack({x, y, x}, 0);
       }},
      {"leaf_sum dim", [&] { return tt::leaf_sum(x, std::vector<int64_t>{1}, true); }},
      {"leaf_mean dim", [&] { return tt::leaf_mean(x, std::vector<int64_t>{0}); }},
      {"leaf_std dim", [&] { return tt::leaf_std(x, std::vector<int64_t>{1}, false); }},
      {"leaf_norm", [&] { return tt::leaf_norm(x, 3.0); }},
      {"leaf_all dim", [&] { return tt::leaf_all(m, 1); }},
      {"leaf_masked_select", [&] { return tt::leaf_masked_select(x, tt::Operand(m)); }},
  };
  asyncs::Thread worker("every op");
  for (const auto& [name, op] : ops) {
    SCOPED_TRACE(name);
    const TreeTensor want = op();
    TreeTensor got;
    {
      asyncs::ThreadScope scope(worker);
      got = op();
    }
    EXPECT_TRUE(got.is_pending()) << "the op did not go pending";
    expect_same(got, want);
  }
}

// Random programs of pending scoped calls on several threads against the same program run
// without scopes: every value equal. The fixture's watchdog turns a hang into a failure.
TEST_F(AsyncsPending, StressRandomScopedProgramsEqualTheUnscopedProgram) {
  std::mt19937 rng(1234);
  asyncs::Thread w1("stress 1"), w2("stress 2");
  for (int round = 0; round < 60; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    at::manual_seed(round);
    std::vector<TreeTensor> a(4), b(4);
    for (std::size_t k = 0; k < a.size(); ++k) {
      a[k] = randn_tree({{"p", {4096}}, {"q", {{"r", {64, 32}}, {"s", {3}}}}});
      b[k] = tt::clone(a[k]);
    }
    std::vector<int> steps(40);
    for (auto& s : steps) s = static_cast<int>(rng() % 1000);
    const auto program = [&](std::vector<TreeTensor>& v, bool scoped) {
      for (std::size_t i = 0; i < steps.size(); ++i) {
        const int s = steps[i];
        const std::size_t k = s % v.size(), j = (s / 4) % v.size();
        std::optional<asyncs::ThreadScope> scope;
        if (scoped && s % 3 != 0) scope.emplace((s / 16) % 2 ? w1 : w2);
        switch ((s / 32) % 6) {
          case 0:
            v[k] = v[k] + v[j];
            break;
          case 1:
            v[k].mul_(0.5);
            break;
          case 2:
            v[k] = tt::tanh(v[j]) - v[k];
            break;
          case 3:
            v[k].add_(v[j], 0.25);
            break;
          case 4:
            v[k] = tt::leaf_mean(v[j]) + v[k];
            break;
          default:
            v[k] = tt::clamp(v[k], -2.0, 2.0);
            break;
        }
      }
    };
    program(a, true);
    program(b, false);
    for (std::size_t k = 0; k < a.size(); ++k) expect_same(a[k], b[k]);
  }
}
