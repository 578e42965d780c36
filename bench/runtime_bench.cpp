// Runtime micro-benchmarks (DESIGN.md §6, §8): fork-join overhead of an empty tree call, and
// 200 leaves of S×2S @ 2S×4S float32 matmul under every strategy against the native loop.
// Results are kept alive as a tree keeps them (each iteration overwrites the previous ones).
// Ratios: run with --benchmark_format=json and divide native's time by each strategy's.
#include "treetensor/runtime/dispatch.hpp"
#include "treetensor/runtime/stream.hpp"

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <sys/resource.h>

#include <string>
#include <vector>

namespace rt = treetensor::runtime;

namespace {

std::string label(std::size_t i) {
  return "leaf" + std::to_string(i);
}

rt::StreamMode mode_of(const std::string& name) {
  if (name == "linear") return rt::StreamMode::of(1);
  if (name == "stream2") return rt::StreamMode::of(2);
  if (name == "auto") return rt::StreamMode::of(rt::automatic);
  return rt::StreamMode::of(rt::fused);
}

void fork_join(benchmark::State& state, const std::string& strategy) {
  const auto leaves = static_cast<std::size_t>(state.range(0));
  std::vector<int> sink(leaves);
  auto leaf = [&](std::size_t i) { benchmark::DoNotOptimize(sink[i] += 1); };
  rt::LeafCall call;
  call.op = "empty";
  call.leaves = leaves;
  call.run = leaf;
  call.label = label;
  rt::StreamGuard guard(mode_of(strategy));
  for (auto _ : state) rt::run(call);
  state.counters["leaves"] = static_cast<double>(leaves);
}

long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

struct MatmulCase {
  std::vector<at::Tensor> a, b, out;
  at::Tensor fused_out;

  explicit MatmulCase(int64_t s, std::size_t leaves = 200) : out(leaves) {
    at::manual_seed(0);
    for (std::size_t i = 0; i < leaves; ++i) {
      a.push_back(at::randn({s, 2 * s}));
      b.push_back(at::randn({2 * s, 4 * s}));
    }
  }
};

void matmul(benchmark::State& state, const std::string& strategy) {
  const int64_t s = state.range(0);
  MatmulCase c(s);
  const double s3 = static_cast<double>(s * s * s);
  auto leaf = [&](std::size_t i) { c.out[i] = at::matmul(c.a[i], c.b[i]); };
  auto cost = [&](std::size_t) {
    return rt::LeafCost{2.0 * 8 * s3, 4.0 * static_cast<double>(2 * s * s + 8 * s * s + 4 * s * s)};
  };
  // The fused form the tensor layer provides for matmul: one bmm over stacked leaves.
  auto fused = [&] {
    c.fused_out = at::bmm(at::stack(c.a), at::stack(c.b));
    auto parts = c.fused_out.unbind(0);
    for (std::size_t i = 0; i < parts.size(); ++i) c.out[i] = parts[i];
    return true;
  };
  rt::LeafCall call;
  call.op = "matmul";
  call.leaves = c.a.size();
  call.run = leaf;
  call.label = label;
  call.cost = cost;
  call.fused = fused;
  long faults_before = minor_faults();
  if (strategy == "native") {
    for (auto _ : state)
      for (std::size_t i = 0; i < c.a.size(); ++i) c.out[i] = at::matmul(c.a[i], c.b[i]);
  } else {
    rt::StreamGuard guard(mode_of(strategy));
    // automatic: its one-time exploration of this shape (a few calls) is a warm-up, as
    // Google Benchmark's own first runs are; the figure is the steady state.
    if (strategy == "auto") {
      for (int i = 0; i < 8; ++i) rt::run(call);
      faults_before = minor_faults();
    }
    for (auto _ : state) rt::run(call);
    if (strategy == "auto") state.SetLabel(rt::explain(call).reason);
  }
  // Page faults taken per call (fresh output pages, DESIGN.md §6).
  state.counters["faults"] = benchmark::Counter(static_cast<double>(minor_faults() - faults_before),
                                                benchmark::Counter::kAvgIterations);
  state.counters["GFLOP/s"] = benchmark::Counter(16.0 * s3 * static_cast<double>(c.a.size()),
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

int main(int argc, char** argv) {
  at::manual_seed(0);
  for (const char* strategy : {"linear", "stream2", "auto"})
    benchmark::RegisterBenchmark(("fork_join_empty/" + std::string(strategy)).c_str(), fork_join,
                                 std::string(strategy))
        ->Arg(1)
        ->Arg(10)
        ->Arg(200)
        ->Unit(benchmark::kMicrosecond);
  // Interleaved by size so the strategies of one S run back to back under the same load.
  for (int64_t s : {16, 32, 64, 128})
    for (const char* strategy : {"native", "linear", "stream2", "auto", "fused"})
      benchmark::RegisterBenchmark(("matmul200/" + std::string(strategy)).c_str(), matmul,
                                   std::string(strategy))
          ->Arg(s)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
