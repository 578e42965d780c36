// Micro-benchmarks of the tree layer: flatten, unflatten, map and a 3-tree zip-map on int-leaf
// trees of about 50, 500 and 5,000 nodes. Each reports `ns_per_node` (CPU time per iteration
// divided by the node count, internal nodes and the root included). Goal: under 20 ns per node
// (optree's C++ core: about 54 ns to flatten, 110 to unflatten).
#include <benchmark/benchmark.h>

#include <array>
#include <cstddef>
#include <string>
#include <utility>

#include "treetensor/tree/tree.hpp"

namespace {

namespace tr = treetensor::tree;
using IntTree = tr::Tree<int>;

// Leaf names as in a model's state dict; a fifth of them are longer than the 15 characters
// std::string keeps inline.
constexpr std::array<const char*, 5> kLeafNames{"weight", "bias", "running_mean", "running_var",
                                                "num_batches_tracked"};

// A balanced tree: `fanout` children per internal node, `depth` key levels; internal keys look
// like "layer3", leaf keys like "running_mean7". Leaves count up from `next`.
IntTree make_tree(int fanout, int depth, int& next) {
  if (depth == 0) return next++;
  IntTree::Children children;
  for (int i = 0; i < fanout; ++i) {
    std::string key = depth == 1 ? kLeafNames[i % kLeafNames.size()] + std::to_string(i)
                                 : "layer" + std::to_string(i);
    children.emplace_back(std::move(key), make_tree(fanout, depth - 1, next));
  }
  return IntTree::from_children(std::move(children));
}

struct Shape {
  int fanout, depth;
};
// 57, 585 and 5,220 nodes.
constexpr std::array<Shape, 3> kShapes{{{7, 2}, {8, 3}, {17, 3}}};

IntTree tree_for(const benchmark::State& state, int first = 0) {
  const Shape s = kShapes[static_cast<std::size_t>(state.range(0))];
  return make_tree(s.fanout, s.depth, first);
}

std::size_t node_count(const IntTree& t) {
  return tr::flatten(t).spec.node_count();
}

// ns_per_node = CPU seconds / (iterations * nodes * 1e-9). (The console prints an inverted
// rate with an "s" suffix; the number is nanoseconds per node.)
void report(benchmark::State& state, const IntTree& t) {
  const auto nodes = static_cast<double>(node_count(t));
  state.counters["nodes"] = nodes;
  state.counters["ns_per_node"] = benchmark::Counter(
      nodes * 1e-9, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

void BM_TreeFlatten(benchmark::State& state) {
  const IntTree t = tree_for(state);
  for (auto _ : state) {
    auto flat = tr::flatten(t);
    benchmark::DoNotOptimize(flat);
  }
  report(state, t);
}

void BM_TreeUnflatten(benchmark::State& state) {
  const IntTree t = tree_for(state);
  const auto flat = tr::flatten(t);
  for (auto _ : state) {
    IntTree back = tr::unflatten(flat.spec, flat.leaves);
    benchmark::DoNotOptimize(back);
  }
  report(state, t);
}

void BM_TreeMap(benchmark::State& state) {
  const IntTree t = tree_for(state);
  for (auto _ : state) {
    IntTree out = tr::map([](int v) { return v + 1; }, t);
    benchmark::DoNotOptimize(out);
  }
  report(state, t);
}

void BM_TreeZipMap3(benchmark::State& state) {
  const IntTree a = tree_for(state), b = tree_for(state, 1000), c = tree_for(state, 2000);
  for (auto _ : state) {
    IntTree out = tr::zip_map([](int x, int y, int z) { return x + y * z; }, a, b, c);
    benchmark::DoNotOptimize(out);
  }
  report(state, a);
}

BENCHMARK(BM_TreeFlatten)->DenseRange(0, 2);
BENCHMARK(BM_TreeUnflatten)->DenseRange(0, 2);
BENCHMARK(BM_TreeMap)->DenseRange(0, 2);
BENCHMARK(BM_TreeZipMap3)->DenseRange(0, 2);

}  // namespace

BENCHMARK_MAIN();
