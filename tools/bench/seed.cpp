// The seed experiment: N leaves, leaf i computes an S1xS2 @ S2xS3 matmul (DI-treetensor's
// stream-mode experiment), under every strategy, side by side.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <map>

#include "treetensor/runtime/stream.hpp"
#include "treetensor/tensor/ops.hpp"
#include "workloads.hpp"

namespace treetensor::bench {
namespace {

using treetensor::TensorTree;
using treetensor::TreeTensor;

struct SeedInputs {
  TensorMap a, b;             // the native side: keys a0..a{N-1}
  TensorTree ta, tb;          // the same tensors as trees (no copies)
  TensorTree ta_min, tb_min;  // the first N/M leaves, for the `min` row
};

at::Tensor random(std::int64_t rows, std::int64_t cols, const Config& cfg) {
  // Drawn in float32 on the CPU so every dtype and device sees the same values.
  return at::randn({rows, cols}).to(cfg.device, cfg.dtype);
}

SeedInputs make_inputs(const Config& cfg, const SeedSize& s) {
  SeedInputs in;
  std::vector<std::pair<std::string, at::Tensor>> a, b, a_min, b_min;
  const std::size_t min_leaves = cfg.leaves / cfg.lanes;
  for (std::size_t i = 0; i < cfg.leaves; ++i) {
    const std::string key = fmt::format("a{}", i);
    at::Tensor x = random(s.s1, s.s2, cfg), y = random(s.s2, s.s3, cfg);
    in.a.emplace(key, x);
    in.b.emplace(key, y);
    a.emplace_back(key, x);
    b.emplace_back(key, y);
    if (i < min_leaves) {
      a_min.emplace_back(key, x);
      b_min.emplace_back(key, y);
    }
  }
  in.ta = tree::unflatten(a);
  in.tb = tree::unflatten(b);
  in.ta_min = tree::unflatten(a_min);
  in.tb_min = tree::unflatten(b_min);
  return in;
}

// The hand-written loop that keeps every result, as a tree call does.
TensorMap native_matmul(const TensorMap& a, const TensorMap& b) {
  TensorMap out;
  for (const auto& [key, x] : a) out.emplace(key, at::matmul(x, b.at(key)));
  return out;
}

// The seed's own loop: each result is dropped at once. `sink` sees each result; the timed
// instantiation passes one that does nothing, so the loop is exactly the seed's.
template <class Sink>
void native_discard(const TensorMap& a, const TensorMap& b, Sink&& sink) {
  for (const auto& [key, x] : a) sink(key, at::matmul(x, b.at(key)));
}

TensorMap to_map(const TensorTree& t) {
  TensorMap out;
  auto flat = tree::flatten_refs(t);
  auto paths = flat.spec.paths();
  for (std::size_t i = 0; i < paths.size(); ++i) out.emplace(paths[i].str(), *flat.leaves[i]);
  return out;
}

struct Row {
  std::string name;
  std::function<TensorMap()> result;  // for verification
  Candidate candidate;
  std::size_t expected_leaves;
};

// Every strategy as (verification form, timed form). Timed forms keep their result in `keep`
// until release, and the next run of a sample replaces it (RepPlan::min_sample_ms).
std::vector<Row> make_rows(const Config& cfg, const SeedInputs& in,
                           std::shared_ptr<std::vector<TreeTensor>> keep_tree,
                           std::shared_ptr<TensorMap> keep_map) {
  const std::size_t n = cfg.leaves, n_min = cfg.leaves / cfg.lanes;
  auto tree_row = [&](std::string name, runtime::StreamMode mode, const TensorTree& a,
                      const TensorTree& b, std::size_t leaves) {
    auto call = [mode, &a, &b] {
      runtime::StreamGuard guard(mode);
      return treetensor::matmul(a, b);
    };
    auto release = [keep_tree] { keep_tree->clear(); };
    return Row{name,
               [call] { return to_map(call()); },
               {name, [call, keep_tree] { keep_tree->assign(1, call()); }, release},
               leaves};
  };
  const auto linear = runtime::StreamMode::of(1);
  std::vector<Row> rows;
  rows.push_back(tree_row("min", linear, in.ta_min, in.tb_min, n_min));
  rows.push_back({"native",
                  [&in] { return native_matmul(in.a, in.b); },
                  {"native", [&in, keep_map] { *keep_map = native_matmul(in.a, in.b); },
                   [keep_map] { keep_map->clear(); }},
                  n});
  rows.push_back({"native-discard",
                  [&in] {
                    TensorMap seen;
                    native_discard(in.a, in.b, [&](auto& k, at::Tensor r) { seen.emplace(k, r); });
                    return seen;
                  },
                  {"native-discard",
                   [&in] { native_discard(in.a, in.b, [](auto&, const at::Tensor&) {}); },
                   {}},
                  n});
  rows.push_back(tree_row("linear", linear, in.ta, in.tb, n));
  rows.push_back(tree_row("stream", runtime::StreamMode::of(cfg.lanes), in.ta, in.tb, n));
  rows.push_back(tree_row("auto", runtime::StreamMode::of(runtime::automatic), in.ta, in.tb, n));
  rows.push_back(tree_row("fused", runtime::StreamMode::of(runtime::fused), in.ta, in.tb, n));
  return rows;
}

// Each leaf's result against native's, to the matmul rounding bound (a lane runs OpenBLAS
// with one thread, native with all: another summation order). Bounds are computed once per key.
Comparator matmul_comparator(const SeedInputs& in) {
  auto bounds = std::make_shared<TensorMap>();
  return [&in, bounds](const std::string& key, const at::Tensor& got, const at::Tensor& want) {
    auto it = bounds->find(key);
    if (it == bounds->end())
      it =
          bounds
              ->emplace(key, rounding::matmul_bound(in.a.at(key), in.b.at(key), want.scalar_type()))
              .first;
    return rounding::compare_within(got, want, it->second);
  };
}

}  // namespace

WorkloadResult run_seed(const Config& cfg, Progress& progress) {
  WorkloadResult out;
  const auto sync = device_synchronizer(cfg.device);
  nlohmann::json sizes = nlohmann::json::array();
  nlohmann::json reps_used = nlohmann::json::object();
  for (std::size_t k = 0; k < cfg.sizes.size(); ++k) {
    const SeedSize& s = cfg.sizes[k];
    sizes.push_back({{"S1", s.s1}, {"S2", s.s2}, {"S3", s.s3}});
    const std::string stage =
        fmt::format("seed size {}/{}: S={} ({}x{} @ {}x{}, {} leaves)", k + 1, cfg.sizes.size(),
                    s.label(), s.s1, s.s2, s.s2, s.s3, cfg.leaves);
    progress.update(stage, "making inputs");
    at::manual_seed(cfg.seed);
    const SeedInputs in = make_inputs(cfg, s);
    auto keep_tree = std::make_shared<std::vector<TreeTensor>>();
    auto keep_map = std::make_shared<TensorMap>();
    std::vector<Row> rows = make_rows(cfg, in, keep_tree, keep_map);

    progress.update(stage, "verifying against native");
    const TensorMap reference = native_matmul(in.a, in.b);
    Verification verification("S=" + s.label(), matmul_comparator(in), cfg.perturb_row);
    for (const Row& row : rows)
      verification.check(row.name, reference, row.result(), row.expected_leaves);
    out.all_verified = out.all_verified && verification.all_passed();
    out.notes.push_back(verification.note());

    std::vector<Candidate> candidates;
    for (const Row& row : rows) candidates.push_back(row.candidate);
    RepPlan plan = rep_plan(cfg);
    plan.min_sample_ms = kMinSampleMs;
    const RoundRobin measured = time_round_robin(candidates, plan, sync, progress, stage);
    const auto& timings = measured.timings;
    reps_used[s.label()] = measured.reps;
    const double native_ms = timings[1].mean_ms;
    const double flops = s.leaf_flops() * double(cfg.leaves);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      Record r{"seed",
               rows[i].name,
               s.is_sweep_shape() ? nlohmann::json(s.s1) : nlohmann::json(s.label()),
               timings[i].mean_ms,
               timings[i].std_ms,
               flops / (timings[i].mean_ms * 1e6),
               native_ms / timings[i].mean_ms,
               verification.passed(i),
               measured.reps};
      r.extra = {{"calls", measured.calls[i]}};
      out.records.push_back(r);
    }
  }
  progress.clear();
  out.notes.push_back(fmt::format(
      "each sample is the mean of back-to-back calls that take at least {} ms (JSON `calls`)",
      kMinSampleMs));
  out.config = {{"leaves", cfg.leaves},
                {"sizes", sizes},
                {"min_leaves", cfg.leaves / cfg.lanes},
                {"reps_used", reps_used}};
  return out;
}

}  // namespace treetensor::bench
