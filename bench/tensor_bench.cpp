// Per-call overhead of tree-tensor ops against the hand-written std::map loop (the "native"
// baseline of DESIGN.md: tree add on 200 leaves of 4 elements, goal within 10% of native).
//
// BM_AddVsNative times both sides alternately inside one benchmark (so machine noise hits
// both alike) and reports their ratio as the counter `tree_over_native`; the other cases give
// the absolute times. Run: build/bench/tensor_bench --benchmark_min_time=0.5
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <chrono>
#include <future>
#include <map>
#include <string>
#include <vector>

#include "treetensor/asyncs/thread.hpp"
#include "treetensor/runtime/stream.hpp"
#include "treetensor/tensor/tensor.hpp"

namespace tt = treetensor;

namespace {

using Map = std::map<std::string, at::Tensor>;

Map make_map(int64_t leaves, int64_t elements) {
  Map m;
  for (int64_t i = 0; i < leaves; ++i) m.emplace("a" + std::to_string(i), at::randn({elements}));
  return m;
}

// What a LibTorch user writes today: a new map holding every result.
Map native_add(const Map& a, const Map& b) {
  Map out;
  for (const auto& [key, value] : a) out.emplace_hint(out.end(), key, value + b.at(key));
  return out;
}

void BM_NativeMapAdd(benchmark::State& state) {
  const Map a = make_map(state.range(0), 4), b = make_map(state.range(0), 4);
  for (auto _ : state) benchmark::DoNotOptimize(native_add(a, b));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void BM_TreeAdd(benchmark::State& state) {
  const tt::TreeTensor a = tt::from_state_dict(make_map(state.range(0), 4));
  const tt::TreeTensor b = tt::from_state_dict(make_map(state.range(0), 4));
  tt::runtime::StreamGuard linear(1);
  for (auto _ : state) benchmark::DoNotOptimize(a + b);
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void BM_TreeAddInPlace(benchmark::State& state) {
  tt::TreeTensor a = tt::from_state_dict(make_map(state.range(0), 4));
  const tt::TreeTensor b = tt::from_state_dict(make_map(state.range(0), 4));
  tt::runtime::StreamGuard linear(1);
  for (auto _ : state) benchmark::DoNotOptimize(a.add_(b, 1e-9));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void BM_NativeMapAddInPlace(benchmark::State& state) {
  Map a = make_map(state.range(0), 4);
  const Map b = make_map(state.range(0), 4);
  for (auto _ : state)
    for (auto& [key, value] : a) benchmark::DoNotOptimize(value.add_(b.at(key), 1e-9));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

// Both sides in one loop, alternating; the counter is the ratio of their total times.
void BM_AddVsNative(benchmark::State& state) {
  const Map ma = make_map(state.range(0), 4), mb = make_map(state.range(0), 4);
  const tt::TreeTensor ta = tt::from_state_dict(ma), tb = tt::from_state_dict(mb);
  tt::runtime::StreamGuard linear(1);
  using Clock = std::chrono::steady_clock;
  Clock::duration native{}, tree{};
  for (auto _ : state) {
    const auto t0 = Clock::now();
    benchmark::DoNotOptimize(native_add(ma, mb));
    const auto t1 = Clock::now();
    benchmark::DoNotOptimize(ta + tb);
    const auto t2 = Clock::now();
    native += t1 - t0;
    tree += t2 - t1;
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["native_us"] = std::chrono::duration<double, std::micro>(native).count() / n;
  state.counters["tree_us"] = std::chrono::duration<double, std::micro>(tree).count() / n;
  state.counters["tree_over_native"] =
      std::chrono::duration<double>(tree).count() / std::chrono::duration<double>(native).count();
}

// The caller's cost of a tree call inside an asyncs scope (x + 1 on `range(0)` leaves of 16
// floats): batches of 100 calls queued behind a closed gate, so that only the caller's work is
// timed; the jobs run, and their results are dropped, with the clock stopped. range(1) = 0:
// every call reads the same tree; 1: each call of a batch reads its own (its operand keys are
// new to the registry, as a program's fresh tensors are).
void BM_PendingTreeAdd(benchmark::State& state) {
  constexpr int kBatch = 100;
  std::vector<tt::TreeTensor> inputs(state.range(1) != 0 ? kBatch : 1);
  for (auto& x : inputs) {
    std::vector<std::pair<std::string, at::Tensor>> leaves;
    for (int64_t i = 0; i < state.range(0); ++i)
      leaves.emplace_back("l" + std::to_string(i), at::randn({16}));
    x = tt::tree::unflatten(leaves);
  }
  tt::asyncs::Thread worker("bench");
  std::vector<tt::TreeTensor> keep;
  keep.reserve(kBatch);
  for (auto _ : state) {
    state.PauseTiming();
    std::promise<void> gate;
    worker.submit([f = gate.get_future()] { f.wait(); });
    state.ResumeTiming();
    {
      tt::asyncs::ThreadScope scope(worker);
      for (int i = 0; i < kBatch; ++i) keep.push_back(inputs[i % inputs.size()] + 1);
    }
    state.PauseTiming();
    gate.set_value();
    worker.wait_idle();
    keep.clear();
    state.ResumeTiming();
  }
  state.SetItemsProcessed(state.iterations() * kBatch);
}

}  // namespace

BENCHMARK(BM_NativeMapAdd)->Arg(1)->Arg(10)->Arg(200);
BENCHMARK(BM_TreeAdd)->Arg(1)->Arg(10)->Arg(200);
BENCHMARK(BM_NativeMapAddInPlace)->Arg(200);
BENCHMARK(BM_TreeAddInPlace)->Arg(200);
BENCHMARK(BM_AddVsNative)->Arg(200);
BENCHMARK(BM_PendingTreeAdd)->Args({40, 0})->Args({40, 1});

BENCHMARK_MAIN();
