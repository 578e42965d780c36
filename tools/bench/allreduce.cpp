// The allreduce workload: the gradient tree of real models all-reduced across local ranks
// (rows: see kAllreduceRows in config.cpp). Runs in every rank; rank 0 reports.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <map>

#include "treetensor/asyncs/thread.hpp"
#include "treetensor/distributed/process_group.hpp"
#include "treetensor/tensor/consolidate.hpp"
#include "treetensor/tree/flatten.hpp"
#include "workloads.hpp"

namespace treetensor::bench {

namespace {

namespace dist = treetensor::distributed;

// Rank r's gradient element j of tensor i: an integer in [-8, 8], so the sum over ranks is
// exact in every float dtype and the expectation can be computed by hand.
at::Tensor gradient(const std::vector<std::int64_t>& shape, std::int64_t i, std::int64_t r,
                    const Config& cfg) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  auto j = at::arange(n, at::kLong);
  return (at::remainder(j + 3 * i + 5 * r, 17) - 8).to(cfg.dtype).reshape(shape);
}

struct Grads {
  std::vector<std::string> keys;
  std::vector<at::Tensor> tensors;  // the tree's leaves (native works on them too)
  TreeTensor tree;
  at::Tensor flat;          // limit: one buffer of all the elements
  TreeTensor consolidated;  // a consolidated copy of the tree (its buffer: cbuffer)
  at::Tensor cbuffer;
  std::vector<at::Tensor> initial;  // to restore after each repetition
  at::Tensor initial_flat, initial_cbuffer;
};

Grads make_grads(const ModelShapes& m, int rank, const Config& cfg) {
  Grads g;
  std::vector<std::pair<std::string, at::Tensor>> pairs;
  std::vector<at::Tensor> flat;
  for (std::size_t i = 0; i < m.trainable.size(); ++i) {
    g.keys.push_back(m.trainable[i].key);
    g.tensors.push_back(gradient(m.trainable[i].shape, std::int64_t(i), rank, cfg));
    g.initial.push_back(g.tensors.back().clone());
    pairs.emplace_back(g.keys.back(), g.tensors.back());
    flat.push_back(g.tensors.back().reshape({-1}));
  }
  g.tree = tree::unflatten(pairs);
  g.flat = at::cat(flat);
  g.initial_flat = g.flat.clone();
  g.consolidated = consolidate(g.tree);
  g.cbuffer = consolidated_groups(g.consolidated).at(0).buffer;  // one dtype: one buffer
  g.initial_cbuffer = g.cbuffer.clone();
  return g;
}

void restore(Grads& g) {
  for (std::size_t i = 0; i < g.tensors.size(); ++i) g.tensors[i].copy_(g.initial[i]);
  g.flat.copy_(g.initial_flat);
  g.cbuffer.copy_(g.initial_cbuffer);
}

TensorMap by_key(const Grads& g) {
  TensorMap out;
  for (std::size_t i = 0; i < g.keys.size(); ++i) out.emplace(g.keys[i], g.tensors[i]);
  return out;
}

TensorMap by_key(const TreeTensor& t) {
  TensorMap out;
  const auto flat = tree::flatten(t);
  const auto paths = flat.spec.paths();
  for (std::size_t i = 0; i < paths.size(); ++i) out.emplace(paths[i].str(), flat.leaves[i]);
  return out;
}

// The main thread's work beside the communication: a chain of matmuls.
struct Compute {
  at::Tensor a, b;
  std::size_t n;
  void operator()() const {
    at::Tensor x = a;
    for (std::size_t k = 0; k < n; ++k) x = at::mm(x, b);
    (void)x.sum().item<float>();
  }
};

}  // namespace

WorkloadResult run_allreduce(const Config& cfg, Progress& progress) {
  at::set_num_threads(1);  // ranks share the cores
  dist::Options options;
  options.timeout = std::chrono::seconds(120);
  const auto group = dist::ProcessGroup::from_env(options);
  const int rank = group.rank(), world = group.world_size();
  asyncs::Thread comm("allreduce");
  at::manual_seed(cfg.seed);
  const Compute compute{at::randn({384, 384}) * 0.05, at::randn({384, 384}) * 0.05,
                        cfg.compute_matmuls};

  WorkloadResult out;
  const std::vector<std::string> rows = {"native",       "tree",  "consolidated", "limit",
                                         "tree+compute", "async", "compute"};
  nlohmann::json tensors, elements, reps_used;
  for (const auto& path : cfg.model_paths) {
    const ModelShapes model = load_model(path);
    const std::string stage =
        fmt::format("allreduce {} ({} tensors, {} elements, {} ranks)", model.name,
                    model.trainable.size(), model.elements, world);
    progress.update(stage, "making the gradients");
    Grads g = make_grads(model, rank, cfg);
    // The hand-computed sum over ranks.
    TensorMap want;
    for (std::size_t i = 0; i < g.keys.size(); ++i) {
      at::Tensor s = at::zeros_like(g.tensors[i]);
      for (int r = 0; r < world; ++r)
        s += gradient(model.trainable[i].shape, std::int64_t(i), r, cfg);
      want.emplace(g.keys[i], s);
    }
    std::vector<at::Tensor> want_flat;
    for (const auto& k : g.keys) want_flat.push_back(want.at(k).reshape({-1}));
    const at::Tensor want_buffer = at::cat(want_flat);

    auto native = [&] { dist::all_reduce_each(group, g.tensors); };
    auto tree = [&] { dist::all_reduce(group, g.tree); };
    auto consolidated = [&] { dist::all_reduce(group, g.consolidated); };
    auto limit = [&] { dist::all_reduce_each(group, {g.flat}); };
    auto tree_compute = [&] {
      dist::all_reduce(group, g.tree);
      compute();
    };
    auto async = [&] {
      auto f = comm.submit([&] { dist::all_reduce(group, g.tree); }, {}, g.tensors, "all_reduce");
      compute();
      f.wait();
    };
    const std::vector<std::function<void()>> fns = {native,       tree,  consolidated, limit,
                                                    tree_compute, async, compute};

    progress.update(stage, "verifying on every rank");
    // Bitwise: integer-valued sums are exact whatever the order of the reduction.
    Verification verification(
        model.name,
        [](const std::string&, const at::Tensor& got, const at::Tensor& w) {
          return rounding::compare_bitwise(got, w);
        },
        rank == 0 ? cfg.perturb_row : "");
    bool limit_ok = true;
    std::vector<std::string> verified_rows;
    for (std::size_t k = 0; k < rows.size(); ++k) {
      if (rows[k] == "compute") continue;
      restore(g);
      fns[k]();
      if (rows[k] == "limit") {
        limit_ok = at::equal(g.flat, want_buffer);
        continue;
      }
      verified_rows.push_back(rows[k]);
      verification.check(rows[k], want,
                         rows[k] == "consolidated" ? by_key(g.consolidated) : by_key(g),
                         want.size());
    }
    restore(g);
    // Every rank's verdicts, summed over ranks with the tree collective itself (0 = agreed).
    TreeTensor verdicts;
    for (std::size_t k = 0; k < verified_rows.size(); ++k)
      verdicts.insert(verified_rows[k],
                      TreeTensor(at::full({1}, verification.passed(k) ? 0 : 1, at::kLong)));
    verdicts.insert("limit", TreeTensor(at::full({1}, limit_ok ? 0 : 1, at::kLong)));
    dist::all_reduce(group, verdicts);
    auto failed_on_any = [&](const std::string& row) {
      return verdicts[row].leaf().item<std::int64_t>() != 0;
    };

    std::vector<Candidate> candidates;
    for (std::size_t k = 0; k < rows.size(); ++k)
      candidates.push_back({rows[k], fns[k], [&g] { restore(g); }});
    RepPlan plan;
    plan.warmup = std::max<std::size_t>(cfg.warmup > 2 ? 2 : cfg.warmup, 1);
    plan.fixed = cfg.reps;
    const RoundRobin measured = time_round_robin(
        candidates, plan, [] {}, progress, stage);
    progress.clear();
    const auto& t = measured.timings;
    for (std::size_t k = 0; k < rows.size(); ++k) {
      bool ok = true;
      if (rows[k] == "limit")
        ok = !failed_on_any("limit");
      else if (rows[k] != "compute")
        ok = !failed_on_any(rows[k]);
      Record r{"allreduce",
               rows[k],
               model.name,
               t[k].mean_ms,
               t[k].std_ms,
               std::nullopt,
               t[0].mean_ms / t[k].mean_ms,
               ok,
               measured.reps};
      // Algorithm bandwidth, as nccl-tests' algbw: the bytes each rank reduces / mean time.
      if (rows[k] != "compute")
        r.gbps =
            double(model.elements) * double(c10::elementSize(cfg.dtype)) / (t[k].mean_ms * 1e6);
      out.records.push_back(std::move(r));
      out.all_verified = out.all_verified && ok;
    }
    std::string note =
        verification.note() + fmt::format(" (rank 0's check; on all {} ranks: ", world);
    std::string bad;
    for (const auto& row : verified_rows)
      if (failed_on_any(row)) bad += (bad.empty() ? "" : ", ") + row;
    if (failed_on_any("limit")) bad += (bad.empty() ? "" : ", ") + std::string("limit");
    note += bad.empty() ? "every row, limit included, equal to the hand-computed sum)"
                        : "FAILED: " + bad + ")";
    out.notes.push_back(note);
    tensors[model.name] = model.trainable.size();
    elements[model.name] = model.elements;
    reps_used[model.name] = measured.reps;
  }
  out.notes.push_back(fmt::format(
      "compute: {} matmuls 384x384 @ 384x384 on the main thread (one intra-op thread per rank), "
      "a reference, not a strategy; GB/s: gradient bytes per rank / mean time (algbw)",
      cfg.compute_matmuls));
  out.config = {{"models", cfg.models},
                {"ranks", world},
                {"backend", "gloo (c10d), loopback, TCPStore"},
                {"first_bucket_bytes", options.first_bucket_bytes},
                {"bucket_bytes", options.bucket_bytes},
                {"compute_matmuls", cfg.compute_matmuls},
                {"trainable_tensors", tensors},
                {"trainable_elements", elements},
                {"reps_used", reps_used}};
  return out;
}

}  // namespace treetensor::bench
