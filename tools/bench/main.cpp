// treetensor-bench: the seed experiment and an Adam step over a real model, every strategy
// side by side in one run, with a table, JSON and a plot.
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <iostream>

#include "config.hpp"
#include "machine.hpp"
#include "report.hpp"
#include "treetensor/distributed/launch.hpp"
#include "treetensor/distributed/process_group.hpp"
#include "treetensor/runtime/cpu_allocator.hpp"
#include "workloads.hpp"

namespace tb = treetensor::bench;

namespace {

const char* workload_name(tb::Workload w) {
  switch (w) {
    case tb::Workload::seed:
      return "seed";
    case tb::Workload::optimizer:
      return "optimizer";
    case tb::Workload::elementwise:
      return "elementwise";
    case tb::Workload::allreduce:
      return "allreduce";
    case tb::Workload::overlap:
      return "overlap";
  }
  return "?";
}

std::string headline(const tb::Config& cfg) {
  const bool ew = cfg.workload == tb::Workload::elementwise;
  const std::string reps =
      cfg.reps ? std::to_string(cfg.reps)
               : fmt::format("{}..{} (about {:g} s per {})", tb::kAutoRepsMin, tb::kAutoRepsMax,
                             ew ? cfg.elementwise_budget_s : cfg.rep_budget_s,
                             ew ? "size and op; where one round takes longer, T >= 3 after 2 "
                                  "warm-up"
                                : "size");
  const std::string timing = fmt::format(
      "M={}, T={} timed repetitions after {} warm-up, strategies interleaved round-robin",
      cfg.lanes, reps, cfg.warmup);
  if (cfg.workload == tb::Workload::seed)
    return fmt::format("treetensor-bench seed: {} leaves of S1xS2 @ S2xS3, {} on {}; {}",
                       cfg.leaves, tb::dtype_name(cfg.dtype), cfg.device.str(), timing);
  if (cfg.workload == tb::Workload::elementwise)
    return fmt::format(
        "treetensor-bench elementwise: N leaves x E elements, add and "
        "(x*2+y).sigmoid_(), {} on {}; {}",
        tb::dtype_name(cfg.dtype), cfg.device.str(), timing);
  if (cfg.workload == tb::Workload::overlap)
    return fmt::format(
        "treetensor-bench overlap: the seed's loop ({} leaves, S={}, {} steps) with a decoder "
        "and a metrics writer in asyncs scopes, {} on {}; {}",
        cfg.overlap_leaves, cfg.overlap_size, cfg.overlap_steps, tb::dtype_name(cfg.dtype),
        cfg.device.str(), timing);
  if (cfg.workload == tb::Workload::allreduce)
    return fmt::format(
        "treetensor-bench allreduce: gradient trees summed over {} local ranks (Gloo), {}; "
        "T={} timed repetitions after 2 warm-up, strategies interleaved round-robin",
        cfg.ranks, tb::dtype_name(cfg.dtype), cfg.reps);
  return fmt::format("treetensor-bench optimizer: Adam step over {}, {} on {}; {}",
                     cfg.checkpoint.empty() ? cfg.model : cfg.checkpoint, tb::dtype_name(cfg.dtype),
                     cfg.device.str(), timing);
}

// Which CPU allocator served the run, read after it (the environment variable installs the
// caching one lazily, at the first tree call).
std::string allocator_note() {
  namespace rt = treetensor::runtime;
  if (!rt::caching_cpu_allocator_installed()) return "LibTorch's default CPU allocator";
  const auto s = rt::caching_cpu_allocator_stats();
  return fmt::format("treetensor's caching CPU allocator ({} hits, {} misses)", s.hits, s.misses);
}

nlohmann::json config_json(const tb::Config& cfg, const tb::MachineInfo& machine,
                           const tb::WorkloadResult& result) {
  nlohmann::json j = {
      {"workload", workload_name(cfg.workload)},
      {"lanes", cfg.lanes},
      {"reps", cfg.reps ? nlohmann::json(cfg.reps) : nlohmann::json("auto")},
      {"rep_budget_s", cfg.reps ? nlohmann::json() : nlohmann::json(cfg.rep_budget_s)},
      {"warmup", cfg.warmup},
      {"dtype", tb::dtype_name(cfg.dtype)},
      {"device", cfg.device.str()},
      {"seed", cfg.seed},
      {"timing",
       "round-robin: each repetition runs every strategy once, the order rotating; "
       "results kept until the clock stops; device synchronized per repetition"},
      {"verification", result.notes},
      {"all_verified", result.all_verified},
      {"allocator", allocator_note()},
      {"command", cfg.command_line},
      {"machine", machine.to_json()}};
  j.update(result.config);
  return j;
}

// The last line of a run with unverified rows: which, and that they were left out. Returns
// whether there were any (the exit status is then 2, once every output is written).
bool unverified_summary(const std::vector<tb::Record>& records, const std::string& baseline) {
  std::string rows;
  std::size_t n = 0;
  for (const auto& r : records)
    if (!r.verified) {
      const std::string size = r.size.is_string() ? r.size.get<std::string>() : r.size.dump();
      rows += fmt::format("{}{} {} {}", n++ ? ", " : "", r.workload, size, r.strategy);
    }
  if (n)
    std::cerr << fmt::format(
        "treetensor-bench: {} row{} not verified against {} ({}): no speed-up is claimed for "
        "{} and {} left out of the plot; see 'verification' above\n",
        n, n == 1 ? "" : "s", baseline, rows, n == 1 ? "it" : "them",
        n == 1 ? "it is" : "they are");
  return n > 0;
}

int run(const tb::Config& cfg) {
  // Before any measuring: a bad output path must not cost a whole run.
  if (cfg.json_path) tb::check_output_path("--json", *cfg.json_path);
  if (cfg.plot_path) tb::check_output_path("--plot", *cfg.plot_path);
  tb::check_device(cfg);
  if (cfg.caching_allocator) treetensor::runtime::use_caching_cpu_allocator();
  const bool allreduce = cfg.workload == tb::Workload::allreduce;
  // allreduce runs in every rank (see main()); only rank 0 reports.
  const char* rank_env = std::getenv("RANK");
  if (allreduce && rank_env && std::atoi(rank_env) != 0) {
    tb::Progress quiet(false);
    const tb::WorkloadResult result = tb::run_allreduce(cfg, quiet);
    return result.all_verified ? 0 : 2;
  }
  const tb::MachineInfo machine = tb::collect_machine_info();
  std::cout << headline(cfg) << "\n" << machine.describe() << std::flush;
  tb::Progress progress(cfg.progress);
  const bool seed = cfg.workload == tb::Workload::seed;
  const bool elementwise = cfg.workload == tb::Workload::elementwise;
  const bool overlap = cfg.workload == tb::Workload::overlap;
  const tb::WorkloadResult result = seed          ? tb::run_seed(cfg, progress)
                                    : elementwise ? tb::run_elementwise(cfg, progress)
                                    : allreduce   ? tb::run_allreduce(cfg, progress)
                                    : overlap     ? tb::run_overlap(cfg, progress)
                                                  : tb::run_optimizer(cfg, progress);

  for (const auto& note : result.notes) std::cout << "note: " << note << "\n";
  std::cout << "allocator: " << allocator_note() << "\n";
  std::cout << "\n";
  tb::print_table(std::cout, result.records,
                  seed          ? "S"
                  : elementwise ? "NxE op"
                  : overlap     ? "NxS"
                                : "model",
                  overlap ? "sequential" : "native");
  std::cout << std::flush;

  if (cfg.json_path) {
    tb::write_json(*cfg.json_path, config_json(cfg, machine, result), result.records);
    std::cout << "wrote " << *cfg.json_path << "\n";
  }
  if (cfg.plot_path) {
    const std::string title = headline(cfg).substr(0, headline(cfg).find(';')) + "\n" +
                              machine.cpu + ", " + std::to_string(machine.cores) +
                              " cores, LibTorch " + machine.torch_version + ", " +
                              machine.date.substr(0, 10);
    tb::PlotSpec spec;
    spec.title = title;
    spec.size_name = seed ? "S =" : overlap ? "N x S" : "model";
    spec.xlabel = seed          ? "leaf size S (each leaf: S x 2S @ 2S x 4S)"
                  : elementwise ? "N leaves x E elements"
                  : overlap     ? "N leaves x S"
                                : "model";
    // A sweep of S draws as lines; named shapes, models and N x E grids are categories.
    const bool sweep = seed && std::all_of(result.records.begin(), result.records.end(),
                                           [](const tb::Record& r) { return r.size.is_number(); });
    spec.axis = sweep ? tb::Axis::numeric : tb::Axis::categorical;
    if (elementwise) spec.panel_key = "op";
    if (auto missing = tb::write_plot(*cfg.plot_path, result.records, spec))
      std::cout << *missing << "\n";
    else
      std::cout << "wrote " << *cfg.plot_path << "\n";
  }
  return unverified_summary(result.records, overlap ? "sequential" : "native") ? 2 : 0;
}

// allreduce without torchrun's RANK: start cfg.ranks copies of this program with the built-in
// launcher (a deadline kills them if they hang) and report rank 0's exit status.
int launch_ranks(const tb::Config& cfg, int argc, char** argv) {
  namespace dist = treetensor::distributed;
  dist::LaunchOptions o;
  o.nprocs = cfg.ranks;
  o.timeout = std::chrono::minutes(10);
  std::vector<std::string> args(argv + 1, argv + argc);
  const auto result = dist::launch(dist::self_executable(), args, o);
  if (result.ok()) return 0;
  std::cerr << "treetensor-bench allreduce: not every rank finished cleanly:\n"
            << result.describe();
  const int code = result.ranks[0].exit_code;
  return code > 0 ? code : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int exit_code = 0;
  auto cfg = tb::parse_command_line(argc, argv, exit_code);
  if (!cfg) return exit_code;
  try {
    if (cfg->workload == tb::Workload::allreduce && !std::getenv("RANK"))
      return launch_ranks(*cfg, argc, argv);
    return run(*cfg);
  } catch (const c10::Error& e) {
    std::cerr << "\ntreetensor-bench: " << e.what_without_backtrace() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "\ntreetensor-bench: " << e.what() << "\n";
  }
  return 1;
}
