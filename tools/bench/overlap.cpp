// The seed's loop with OneFlow's asyncs scopes (DESIGN.md §10, pending scopes): a training
// step on the main thread, a decoder producing the next batch and a metrics writer beside it,
// run sequentially, in pending scopes and with submit(), side by side; plus each part alone.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "treetensor/asyncs/thread.hpp"
#include "treetensor/runtime/dispatch.hpp"
#include "treetensor/tensor/ops.hpp"
#include "treetensor/tensor/reduce.hpp"
#include "workloads.hpp"

namespace treetensor::bench {
namespace {

namespace tt = treetensor;
using treetensor::TensorTree;
using treetensor::TreeTensor;

// One step's work, the same in every row: only where it runs differs.
struct StepWork {
  std::vector<TreeTensor> codes;  // per step: the encoded batch (N leaves of S x S, uint8)
  at::Tensor basis;               // S x 2S: the decoder's projection
  TreeTensor w0;                  // N leaves of 2S x 4S: the initial weights

  // The decoder: codes to a float batch S x 2S (dequantize, project).
  TreeTensor decode(const TreeTensor& code) const {
    return tt::matmul(tt::to(code, at::kFloat) - 127.5, basis);
  }
  // The training step: the seed's matmul, then an in-place update of the weights.
  static TreeTensor train(const TreeTensor& batch, TreeTensor& w) {
    TreeTensor y = tt::matmul(batch, w);
    w.mul_(0.9999);
    return y;
  }
  // The metrics of one step: per-leaf standard deviation and norm of the outputs.
  static std::pair<TreeTensor, TreeTensor> metrics(const TreeTensor& y) {
    return {tt::leaf_std(y), tt::leaf_norm(y)};
  }
};

// The metrics file of one row: a line per step, every leaf's values at full precision.
class MetricsFile {
 public:
  explicit MetricsFile(std::string path) : path_(std::move(path)) { reset(); }
  ~MetricsFile() { std::filesystem::remove(path_); }
  void reset() { out_.open(path_, std::ios::trunc); }
  void write(std::size_t step, const std::pair<TreeTensor, TreeTensor>& m) {
    out_ << step;
    for (const auto* t : {&m.first, &m.second})
      for (const at::Tensor& v : tree::flatten(*t).leaves)
        out_ << ' ' << fmt::format("{:.9g}", v.item<float>());
    out_ << '\n';
  }
  // The file's bytes, as a tensor for the bitwise comparison.
  at::Tensor bytes() {
    out_.close();
    std::ifstream in(path_, std::ios::binary);
    const std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    reset();
    return at::from_blob(const_cast<char*>(s.data()), {static_cast<int64_t>(s.size())}, at::kByte)
        .clone();
  }

 private:
  std::string path_;
  std::ofstream out_;
};

namespace ns = treetensor::asyncs;

// What a row's loop leaves behind: its weights and metrics file, checked against sequential.
struct RowState {
  explicit RowState(const StepWork& work, const std::string& file)
      : w(tt::clone(work.w0)), metrics(file) {}
  TreeTensor w;
  MetricsFile metrics;
  void restart(const StepWork& work) { w.copy_(work.w0); }
};

using Loop = std::function<void(const StepWork&, RowState&)>;

void sequential(const StepWork& work, RowState& s) {
  TreeTensor batch = work.decode(work.codes[0]);
  for (std::size_t i = 0; i + 1 < work.codes.size(); ++i) {
    TreeTensor next = work.decode(work.codes[i + 1]);
    const TreeTensor y = StepWork::train(batch, s.w);
    s.metrics.write(i, StepWork::metrics(y));
    batch = std::move(next);
  }
}

// OneFlow's loop: the decoder's and the metrics' tree calls in pending scopes; the file write
// (not a tree call) is a job on the metrics thread, after the metrics calls it reads.
Loop scoped(ns::Thread& decoder, ns::Thread& writer) {
  return [&decoder, &writer](const StepWork& work, RowState& s) {
    TreeTensor batch = work.decode(work.codes[0]);
    for (std::size_t i = 0; i + 1 < work.codes.size(); ++i) {
      TreeTensor next;
      {
        ns::ThreadScope scope(decoder);
        next = work.decode(work.codes[i + 1]);
      }
      const TreeTensor y = StepWork::train(batch, s.w);
      std::pair<TreeTensor, TreeTensor> m;
      {
        ns::ThreadScope scope(writer);
        m = StepWork::metrics(y);
      }
      writer.submit([&s, i, m] { s.metrics.write(i, m); }, {}, {}, "write metrics");
      batch = std::move(next);
    }
    runtime::synchronize();
  };
}

// The same overlap by hand: each part a submitted job.
Loop submitted(ns::Thread& decoder, ns::Thread& writer) {
  return [&decoder, &writer](const StepWork& work, RowState& s) {
    TreeTensor batch = work.decode(work.codes[0]);
    for (std::size_t i = 0; i + 1 < work.codes.size(); ++i) {
      auto next = decoder.submit([&work, i] { return work.decode(work.codes[i + 1]); });
      const TreeTensor y = StepWork::train(batch, s.w);
      writer.submit([&s, i, y] { s.metrics.write(i, StepWork::metrics(y)); });
      batch = next.get();
    }
    writer.wait_idle();
  };
}

// Each part alone, for the sum and max of parts.
void decode_alone(const StepWork& work, RowState&) {
  for (std::size_t i = 0; i < work.codes.size(); ++i) (void)work.decode(work.codes[i]);
}
void train_alone(const StepWork& work, RowState& s, const TreeTensor& batch) {
  for (std::size_t i = 0; i + 1 < work.codes.size(); ++i) (void)StepWork::train(batch, s.w);
}
void metrics_alone(const StepWork& work, RowState& s, const TreeTensor& y) {
  for (std::size_t i = 0; i + 1 < work.codes.size(); ++i) s.metrics.write(i, StepWork::metrics(y));
}

StepWork make_work(const Config& cfg) {
  at::manual_seed(static_cast<std::uint64_t>(cfg.seed));
  const std::int64_t s = cfg.overlap_size;
  StepWork w;
  std::vector<std::pair<std::string, at::Tensor>> weights;
  for (std::size_t k = 0; k < cfg.overlap_leaves; ++k)
    weights.emplace_back(fmt::format("l{}", k), at::randn({2 * s, 4 * s}) / std::sqrt(2.0 * s));
  w.w0 = tree::unflatten(weights);
  w.basis = at::randn({s, 2 * s}) / (64 * std::sqrt(double(s)));
  for (std::size_t i = 0; i <= cfg.overlap_steps; ++i) {
    std::vector<std::pair<std::string, at::Tensor>> code;
    for (std::size_t k = 0; k < cfg.overlap_leaves; ++k)
      code.emplace_back(fmt::format("l{}", k), at::randint(0, 256, {s, s}, at::kByte));
    w.codes.push_back(tree::unflatten(code));
  }
  return w;
}

// The least a step can take here (a work-conserving bound): no part runs faster than alone,
// and the cores do at most their count in threads' work at once: train on the main thread's
// intra-op threads (train_threads x its time: exact for one, an upper estimate of its work for
// more), decode and metrics on one thread each.
double machine_floor(double train, double decode, double metrics, std::size_t train_threads,
                     std::size_t cores) {
  const double work = double(train_threads) * train + decode + metrics;
  return std::max({train, decode, metrics, work / double(std::max<std::size_t>(1, cores))});
}

TensorMap outcome(RowState& s) {
  TensorMap out;
  const auto flat = tree::flatten(s.w);
  const auto paths = flat.spec.paths();
  for (std::size_t i = 0; i < paths.size(); ++i) out.emplace("w." + paths[i].str(), flat.leaves[i]);
  out.emplace("metrics file", s.metrics.bytes());
  return out;
}

// The caller's cost of one pending call: calls queued behind a closed gate, so that the time
// measured is the caller's alone (the jobs run after the clock stops).
double pending_call_us(const TreeTensor& x, std::size_t calls) {
  ns::Thread worker("call cost");
  std::promise<void> gate;
  worker.submit([f = gate.get_future().share()] { f.wait(); });
  std::vector<TreeTensor> keep;
  keep.reserve(calls);
  const auto start = std::chrono::steady_clock::now();
  {
    ns::ThreadScope scope(worker);
    for (std::size_t i = 0; i < calls; ++i) keep.push_back(x + 1);
  }
  const double us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  gate.set_value();
  runtime::synchronize();
  return us / double(calls);
}

double direct_call_us(const TreeTensor& x, std::size_t calls) {
  std::vector<TreeTensor> keep;
  keep.reserve(calls);
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < calls; ++i) keep.push_back(x + 1);
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
             .count() /
         double(calls);
}

}  // namespace

WorkloadResult run_overlap(const Config& cfg, Progress& progress) {
  WorkloadResult out;
  const int threads_before = at::get_num_threads();
  at::set_num_threads(static_cast<int>(cfg.overlap_train_threads));
  const StepWork work = make_work(cfg);
  ns::Thread decoder("decoder"), writer("metrics");
  const std::string dir = std::filesystem::temp_directory_path().string();
  const auto file = [&](const std::string& row) {
    return fmt::format("{}/treetensor-overlap-{}-{}.txt", dir, ::getpid(), row);
  };
  struct Row {
    std::string name;
    Loop loop;
    std::unique_ptr<RowState> state;
  };
  std::vector<Row> rows;
  rows.push_back({"sequential", sequential, nullptr});
  rows.push_back({"scoped", scoped(decoder, writer), nullptr});
  rows.push_back({"submit", submitted(decoder, writer), nullptr});
  for (auto& r : rows) r.state = std::make_unique<RowState>(work, file(r.name));

  const std::string stage = fmt::format("overlap: {} leaves, S={}, {} steps", cfg.overlap_leaves,
                                        cfg.overlap_size, cfg.overlap_steps);
  progress.update(stage, "verifying against sequential");
  Verification verification(
      fmt::format("{} steps", cfg.overlap_steps),
      [](const std::string&, const at::Tensor& got, const at::Tensor& want) {
        return rounding::compare_bitwise(got, want);
      },
      cfg.perturb_row, "sequential");
  std::vector<TensorMap> outcomes;
  for (auto& r : rows) {
    r.loop(work, *r.state);
    outcomes.push_back(outcome(*r.state));
    r.state->restart(work);
  }
  for (std::size_t i = 0; i < rows.size(); ++i)
    verification.check(rows[i].name, outcomes[0], outcomes[i], outcomes[0].size());
  out.all_verified = verification.all_passed();
  out.notes.push_back(verification.note() + " (the final weights and the metrics file)");

  RowState alone(work, file("alone"));
  const TreeTensor batch0 = work.decode(work.codes[0]);
  const TreeTensor y = StepWork::train(batch0, alone.w);
  std::vector<Candidate> candidates;
  for (auto& r : rows)
    candidates.push_back(
        {r.name, [&work, &r] { r.loop(work, *r.state); }, [&work, &r] { r.state->restart(work); }});
  candidates.push_back({"decode-alone", [&] { decode_alone(work, alone); }, {}});
  candidates.push_back(
      {"train-alone", [&] { train_alone(work, alone, batch0); }, [&] { alone.restart(work); }});
  candidates.push_back(
      {"metrics-alone", [&] { metrics_alone(work, alone, y); }, [&] { alone.metrics.reset(); }});
  const RoundRobin measured = time_round_robin(
      candidates, rep_plan(cfg), [] {}, progress, stage);
  const double steps = double(cfg.overlap_steps);
  const double seq = measured.timings[0].mean_ms / steps;
  const auto record = [&](const std::string& name, double mean, double sd, bool verified) {
    out.records.push_back({"overlap", name,
                           fmt::format("{}x{}", cfg.overlap_leaves, cfg.overlap_size), mean, sd,
                           std::nullopt, seq / mean, verified, measured.reps,
                           nlohmann::json::object(), std::nullopt});
  };
  for (std::size_t i = 0; i < candidates.size(); ++i)
    record(candidates[i].name, measured.timings[i].mean_ms / steps,
           measured.timings[i].std_ms / steps, i >= rows.size() || verification.passed(i));
  std::vector<double> part;  // ms per step alone: decode, train, metrics (the candidates' order)
  double sum = 0, var = 0, max = 0, max_sd = 0;
  for (std::size_t i = rows.size(); i < candidates.size(); ++i) {
    const Timing& t = measured.timings[i];
    part.push_back(t.mean_ms / steps);
    sum += part.back();
    var += (t.std_ms / steps) * (t.std_ms / steps);
    if (part.back() > max) max = part.back(), max_sd = t.std_ms / steps;
  }
  record("sum-of-parts", sum, std::sqrt(var), true);
  record("max-of-parts", max, max_sd, true);
  const double scoped_ms = measured.timings[1].mean_ms / steps;
  out.notes.push_back(fmt::format(
      "overlap: scoped {:.3f} ms per step = {:.2f}x max of parts ({:.3f} ms), {:.2f}x sequential "
      "({:.3f} ms); main thread {} intra-op thread(s), decoder and metrics on asyncs threads of "
      "1 each",
      scoped_ms, scoped_ms / max, max, scoped_ms / seq, seq, cfg.overlap_train_threads));
  const std::size_t cores = std::thread::hardware_concurrency();  // the JSON's machine.cores
  const double bound = machine_floor(part[1], part[0], part[2], cfg.overlap_train_threads, cores);
  out.notes.push_back(fmt::format(
      "overlap on this machine ({} cores, {} intra-op thread(s) on the main thread): floor "
      "max(each part alone, their work / cores) {:.3f} ms; scoped is {:.2f}x it",
      cores, cfg.overlap_train_threads, bound, scoped_ms / bound));

  progress.update(stage, "the caller's cost of a pending call");
  at::manual_seed(1);
  std::vector<std::pair<std::string, at::Tensor>> small;
  for (std::size_t k = 0; k < cfg.overlap_leaves; ++k)
    small.emplace_back(fmt::format("l{}", k), at::randn({16}));
  const TreeTensor x = tree::unflatten(small);
  (void)pending_call_us(x, 50);  // warm-up: the worker's first job, the hooks
  const double pending_us = pending_call_us(x, 400), direct_us = direct_call_us(x, 400);
  out.notes.push_back(fmt::format(
      "pending call (x + 1, {} leaves of 16 floats): {:.2f} us on the caller, the whole direct "
      "call {:.2f} us",
      cfg.overlap_leaves, pending_us, direct_us));
  progress.clear();
  at::set_num_threads(threads_before);
  out.config = {{"overlap_leaves", cfg.overlap_leaves},
                {"overlap_size", cfg.overlap_size},
                {"overlap_steps", cfg.overlap_steps},
                {"train_threads", cfg.overlap_train_threads},
                {"pending_call_us", pending_us},
                {"direct_call_us", direct_us},
                {"scoped_over_max_of_parts", scoped_ms / max},
                {"machine_floor_ms", bound},
                {"scoped_over_machine_floor", scoped_ms / bound}};
  return out;
}

}  // namespace treetensor::bench
