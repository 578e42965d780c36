// asyncs threads: submit-to-start latency and throughput of tiny jobs on one thread, and the
// cost of operand tracking on the tree-call path.
//
//   asyncs_bench --benchmark_min_time=0.2
#include "treetensor/asyncs/operands.hpp"
#include "treetensor/asyncs/thread.hpp"

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <chrono>
#include <future>

namespace asyncs = treetensor::asyncs;
using Clock = std::chrono::steady_clock;

namespace {

// Time from submit() to the job's first instruction, the worker parked in between (the
// usual case for a metric thread that gets one job per training step).
void BM_SubmitToStart(benchmark::State& state) {
  asyncs::Thread t;
  for (auto _ : state) {
    const auto submitted = Clock::now();
    const auto started = t.submit([] { return Clock::now(); }).get();
    state.SetIterationTime(std::chrono::duration<double>(started - submitted).count());
  }
}
BENCHMARK(BM_SubmitToStart)->UseManualTime()->Unit(benchmark::kMicrosecond);

// submit() + get() of an empty job: the full round trip through the worker.
void BM_RoundTrip(benchmark::State& state) {
  asyncs::Thread t;
  for (auto _ : state) t.submit([] {}).get();
}
BENCHMARK(BM_RoundTrip)->UseRealTime()->Unit(benchmark::kMicrosecond);

// Throughput: a burst of `range(0)` tiny jobs, then wait for the queue to drain.
void BM_Throughput(benchmark::State& state) {
  asyncs::Thread t;
  const auto jobs = state.range(0);
  long sum = 0;
  for (auto _ : state) {
    for (long i = 0; i < jobs; ++i) t.submit([&sum, i] { sum += i; });
    t.wait_idle();
  }
  benchmark::DoNotOptimize(sum);
  state.SetItemsProcessed(state.iterations() * jobs);
}
BENCHMARK(BM_Throughput)->Arg(1000)->UseRealTime()->Unit(benchmark::kMicrosecond);

// The same with one tracked read operand per job (registration and release of its key).
void BM_ThroughputWithOperand(benchmark::State& state) {
  asyncs::Thread t;
  const auto jobs = state.range(0);
  const at::Tensor x = at::zeros({4});
  for (auto _ : state) {
    for (long i = 0; i < jobs; ++i) t.submit([] {}, {x}, {});
    t.wait_idle();
  }
  state.SetItemsProcessed(state.iterations() * jobs);
}
BENCHMARK(BM_ThroughputWithOperand)->Arg(1000)->UseRealTime()->Unit(benchmark::kMicrosecond);

// What every tree call pays when no asyncs work is pending.
void BM_TrackingInactive(benchmark::State& state) {
  const at::Tensor x = at::zeros({4});
  for (auto _ : state) {
    if (asyncs::tracking_active()) asyncs::await_operands({x}, {x});
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_TrackingInactive);

// A tree call's check while a job on another tensor is pending: a registry lookup, no wait.
void BM_AwaitOperandsNoConflict(benchmark::State& state) {
  asyncs::Thread t;
  const at::Tensor busy = at::zeros({4});
  const at::Tensor x = at::zeros({4});
  std::promise<void> gate;
  t.submit([f = gate.get_future()] { f.wait(); }, {}, {busy});
  for (auto _ : state) {
    if (asyncs::tracking_active()) asyncs::await_operands({x}, {x});
  }
  gate.set_value();
}
BENCHMARK(BM_AwaitOperandsNoConflict);

}  // namespace

BENCHMARK_MAIN();
