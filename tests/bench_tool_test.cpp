// treetensor-bench end to end: runs the built tool with tiny sizes and checks its JSON (the
// documented names other tools read), its verification, the model parameter counts, --help and
// its errors.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "run_command.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using Outcome = tt_test::CommandResult;

// Runs the tool through the shell; `prefix` goes before it (e.g. "PATH=... ").
Outcome run_bench_with_prefix(const std::string& prefix, const std::string& args) {
  return tt_test::run_command(prefix + std::string(TREETENSOR_BENCH_EXE) + " " + args + " 2>&1");
}

Outcome run_bench(const std::string& args) {
  return run_bench_with_prefix("", args);
}

class BenchTool : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("treetensor_bench_test_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  static json read_json(const std::string& file) {
    std::ifstream f(file);
    return json::parse(f);
  }
  fs::path dir_;
};

const std::set<std::string> kRecordKeys = {"workload",          "strategy", "role",   "size",
                                           "mean_ms",           "std_ms",   "gflops", "gbps",
                                           "speedup_vs_native", "verified", "noisy"};

// Bounds and references are told apart from strategies, in the JSON and in the table.
std::string expected_role(const std::string& strategy) {
  if (strategy == "min" || strategy == "limit" || strategy == "one-call" ||
      strategy == "max-of-parts")
    return "bound";
  if (strategy == "compute" || strategy == "native-discard" || strategy == "sum-of-parts" ||
      strategy.ends_with("-alone"))
    return "reference";
  return "strategy";
}

// The table line of `strategy` at `size` (the first column), or "" when there is none.
std::string table_line(const std::string& output, const std::string& size,
                       const std::string& strategy) {
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    std::istringstream words(line);
    std::string first, second;
    words >> first >> second;
    if (first == size && second == strategy) return line;
  }
  return "";
}

// `extra`: the workload's own keys (seed: `calls`, the calls per timed sample).
void expect_record_shape(const json& r, const std::set<std::string>& extra = {}) {
  std::set<std::string> keys, want = kRecordKeys;
  for (const auto& [k, v] : r.items()) keys.insert(k);
  want.insert(extra.begin(), extra.end());
  EXPECT_EQ(keys, want) << r.dump();
  EXPECT_TRUE(r.at("verified").get<bool>()) << r.dump();
  EXPECT_GT(r.at("mean_ms").get<double>(), 0) << r.dump();
  EXPECT_GE(r.at("std_ms").get<double>(), 0) << r.dump();
  EXPECT_GT(r.at("speedup_vs_native").get<double>(), 0) << r.dump();
  EXPECT_EQ(r.at("role"), expected_role(r.at("strategy").get<std::string>())) << r.dump();
  // Flagged by the spread alone: above a quarter of the mean is noise.
  EXPECT_EQ(r.at("noisy").get<bool>(),
            r.at("std_ms").get<double>() > 0.25 * r.at("mean_ms").get<double>())
      << r.dump();
}

TEST_F(BenchTool, SeedWritesEveryRowVerifiedWithDocumentedNames) {
  const auto out = run_bench("seed -N 6 -M 2 -T 2 --warmup 1 --sizes 4,8 --no-progress --json " +
                             path("seed.json") + " --plot " + path("seed.png"));
  ASSERT_EQ(out.status, 0) << out.output;
  EXPECT_NE(out.output.find("S=4: all 7 strategies match native before timing"), std::string::npos)
      << out.output;
  EXPECT_NE(out.output.find("S=8: all 7 strategies match native before timing"), std::string::npos);
  for (const char* fact : {"machine:", "LibTorch ", "BLAS:", "threads: intra-op", "date: "})
    EXPECT_NE(out.output.find(fact), std::string::npos) << fact << "\n" << out.output;

  const json j = read_json(path("seed.json"));
  EXPECT_EQ(j.at("config").at("workload"), "seed");
  EXPECT_EQ(j.at("config").at("leaves"), 6);
  EXPECT_EQ(j.at("config").at("lanes"), 2);
  EXPECT_EQ(j.at("config").at("min_leaves"), 3);
  EXPECT_TRUE(j.at("config").at("all_verified").get<bool>());
  EXPECT_TRUE(j.at("config").at("machine").contains("blas"));
  const json& results = j.at("results");
  ASSERT_EQ(results.size(), 14u);
  const std::set<std::string> rows = {"min",    "native", "native-discard", "linear",
                                      "stream", "auto",   "fused"};
  std::size_t batched = 0;
  for (int s : {4, 8}) {
    std::set<std::string> seen;
    for (const auto& r : results) {
      if (r.at("size") != s) continue;
      expect_record_shape(r, {"calls"});
      // Back-to-back calls per sample, paced by the warm-up: microsecond rows are batched.
      const auto calls = r.at("calls").get<std::size_t>();
      EXPECT_GE(calls, 1u) << r.dump();
      EXPECT_LE(calls, 1000u) << r.dump();
      if (calls > 1) ++batched;
      EXPECT_EQ(r.at("workload"), "seed");
      seen.insert(r.at("strategy").get<std::string>());
      // GFLOP/s = 2*S1*S2*S3*N / time, with S1=S, S2=2S, S3=4S.
      const double flops = 2.0 * s * (2 * s) * (4 * s) * 6;
      EXPECT_NEAR(r.at("gflops").get<double>(), flops / (r.at("mean_ms").get<double>() * 1e6),
                  1e-9 * flops);
      if (r.at("strategy") == "native") {
        EXPECT_DOUBLE_EQ(r.at("speedup_vs_native").get<double>(), 1.0);
      }
    }
    EXPECT_EQ(seen, rows) << "size " << s;
    // A bound's speed-up in brackets, none for a reference, a strategy's as is.
    EXPECT_NE(table_line(out.output, std::to_string(s), "min").find(")    2  bound"),
              std::string::npos)
        << out.output;
    EXPECT_NE(table_line(out.output, std::to_string(s), "native-discard").find("-    2  reference"),
              std::string::npos)
        << out.output;
    EXPECT_NE(table_line(out.output, std::to_string(s), "stream").find("x    2  yes"),
              std::string::npos)
        << out.output;
  }
  // Calls of microseconds: all batched but for a stalled warm-up call or two.
  EXPECT_GE(batched, results.size() - 2);
  // The plot is a PNG where gnuplot is installed, and the tool says how to get it otherwise.
  if (std::system("command -v gnuplot >/dev/null 2>&1") == 0) {
    std::ifstream png(path("seed.png"), std::ios::binary);
    std::string magic(8, '\0');
    png.read(magic.data(), 8);
    EXPECT_EQ(magic, std::string("\x89PNG\r\n\x1a\n", 8));
  } else {
    EXPECT_NE(out.output.find("apt-get install gnuplot-nox"), std::string::npos);
  }
}

TEST_F(BenchTool, SeedExplicitSizeIsLabelledS1xS2xS3) {
  const auto out = run_bench(
      "seed -N 4 -M 4 -T 1 --warmup 0 --s1 3 --s2 5 --s3 7 --no-progress "
      "--json " +
      path("seed.json"));
  ASSERT_EQ(out.status, 0) << out.output;
  const json j = read_json(path("seed.json"));
  ASSERT_EQ(j.at("results").size(), 7u);
  for (const auto& r : j.at("results")) {
    expect_record_shape(r, {"calls"});
    EXPECT_EQ(r.at("calls").get<std::size_t>(), 1u) << "no warm-up, no pace: one call per sample";
    EXPECT_EQ(r.at("size"), "3x5x7");
  }
  EXPECT_EQ(j.at("config").at("min_leaves"), 1);
}

void check_optimizer(const json& j, const std::string& model, std::size_t tensors,
                     std::int64_t elements) {
  EXPECT_EQ(j.at("config").at("workload"), "optimizer");
  EXPECT_EQ(j.at("config").at("model"), model);
  EXPECT_EQ(j.at("config").at("trainable_tensors"), tensors);
  EXPECT_EQ(j.at("config").at("trainable_elements"), elements);
  std::set<std::string> seen;
  for (const auto& r : j.at("results")) {
    expect_record_shape(r);
    EXPECT_EQ(r.at("workload"), "optimizer");
    EXPECT_EQ(r.at("size"), model);
    EXPECT_TRUE(r.at("gflops").is_null());
    // GB/s: p, g, m, v read and p, m, v written once each (float32).
    EXPECT_NEAR(r.at("gbps").get<double>(),
                7.0 * 4 * double(elements) / (r.at("mean_ms").get<double>() * 1e6),
                1e-9 * r.at("gbps").get<double>());
    seen.insert(r.at("strategy").get<std::string>());
  }
  EXPECT_EQ(seen, (std::set<std::string>{"native", "flat", "limit", "foreach", "linear", "stream",
                                         "auto", "auto-consolidated", "fused"}));
}

TEST_F(BenchTool, OptimizerResNet50TakesOnlyTrainableParameters) {
  const auto out = run_bench("optimizer --model resnet50 -T 1 --warmup 0 --no-progress --json " +
                             path("opt.json"));
  ASSERT_EQ(out.status, 0) << out.output;
  EXPECT_NE(out.output.find("resnet50: all 8 strategies match native before timing"),
            std::string::npos)
      << out.output;
  check_optimizer(read_json(path("opt.json")), "resnet50", 161, 25'557'032);
}

TEST_F(BenchTool, OptimizerMobileNetV3SmallTakesOnlyTrainableParameters) {
  const auto out = run_bench(
      "optimizer --model mobilenet_v3_small -T 2 --warmup 1 --no-progress "
      "--json " +
      path("opt.json"));
  ASSERT_EQ(out.status, 0) << out.output;
  check_optimizer(read_json(path("opt.json")), "mobilenet_v3_small", 142, 2'542'856);
}

// The elementwise grid: one record per (N, E, op, row) with the documented fields, every row
// verified (add bitwise, flat included), and a row made to fail is reported.
TEST_F(BenchTool, ElementwiseGridRecordsEveryRowVerified) {
  const auto out =
      run_bench("elementwise --leaves 3,5 --elements 4,33 -T 1 --warmup 0 --no-progress --json " +
                path("ew.json") + " --plot " + path("ew.png"));
  ASSERT_EQ(out.status, 0) << out.output;
  // One panel per op, log axis (gnuplot would fail on a non-positive value there).
  if (std::system("command -v gnuplot >/dev/null 2>&1") == 0)
    EXPECT_GT(fs::file_size(path("ew.png")), 0u) << out.output;
  EXPECT_NE(out.output.find("3x4 add: all 5 strategies match native before timing; bitwise "
                            "equal: linear, stream, auto, flat, fused"),
            std::string::npos)
      << out.output;
  const json j = read_json(path("ew.json"));
  EXPECT_EQ(j.at("config").at("workload"), "elementwise");
  std::map<std::string, std::set<std::string>> rows;
  for (const auto& r : j.at("results")) {
    EXPECT_EQ(r.at("workload"), "elementwise");
    for (const char* k :
         {"op", "leaves", "elements", "strategy", "mean_ms", "speedup_vs_native", "verified"})
      EXPECT_TRUE(r.contains(k)) << k << " missing in " << r.dump();
    EXPECT_TRUE(r.at("verified").get<bool>()) << r.dump();
    EXPECT_EQ(r.at("role"), expected_role(r.at("strategy").get<std::string>())) << r.dump();
    // GB/s: x and y read, the result written once (float32).
    const double bytes = 3.0 * 4 * r.at("leaves").get<double>() * r.at("elements").get<double>();
    EXPECT_NEAR(r.at("gbps").get<double>(), bytes / (r.at("mean_ms").get<double>() * 1e6),
                1e-9 * r.at("gbps").get<double>());
    rows[r.at("size").get<std::string>()].insert(r.at("strategy").get<std::string>());
  }
  const std::set<std::string> want = {"native", "linear",    "stream", "auto",
                                      "flat",   "flat+read", "fused",  "one-call"};
  ASSERT_EQ(rows.size(), 8u);  // 2 N x 2 E x 2 ops
  for (const auto& [size, seen] : rows) EXPECT_EQ(seen, want) << size;
  const auto bad = run_bench(
      "elementwise --leaves 3 --elements 4 -T 1 --warmup 0 --no-progress "
      "--perturb-row flat");
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_NE(bad.output.find("4 rows not verified against native (elementwise 3x4 add flat, "
                            "elementwise 3x4 add flat+read, elementwise 3x4 chain flat, "
                            "elementwise 3x4 chain flat+read)"),
            std::string::npos)
      << bad.output;
}

// Calls of microseconds are timed in batches: each sample is the mean of back-to-back calls
// that take at least 5 ms at the warm-up's pace (at most 1,000), and each record says how many.
// Without a warm-up there is no pace, and a sample is one call.
TEST_F(BenchTool, ElementwiseTimesMicrosecondCallsInBatches) {
  const auto out = run_bench(
      "elementwise --leaves 3 --elements 4 -T 2 --warmup 8 --no-progress "
      "--json " +
      path("ew.json"));
  ASSERT_EQ(out.status, 0) << out.output;
  EXPECT_NE(out.output.find("each sample is the mean of back-to-back calls that take at least "
                            "5 ms"),
            std::string::npos)
      << out.output;
  const json j = read_json(path("ew.json"));
  std::size_t batched = 0;
  for (const auto& r : j.at("results")) {
    const auto calls = r.at("calls").get<std::size_t>();
    EXPECT_GE(calls, 1u) << r.dump();
    EXPECT_LE(calls, 1000u) << r.dump();
    if (calls > 1) ++batched;
  }
  // A 3x4 call takes microseconds; a loaded machine may stall one row's last warm-up call.
  EXPECT_GE(batched + 2, j.at("results").size()) << j.dump();

  const auto single = run_bench(
      "elementwise --leaves 3 --elements 4 -T 1 --warmup 0 "
      "--no-progress --json " +
      path("one.json"));
  ASSERT_EQ(single.status, 0) << single.output;
  for (const auto& r : read_json(path("one.json")).at("results"))
    EXPECT_EQ(r.at("calls").get<std::size_t>(), 1u) << r.dump();
}

// The overlap workload (pending asyncs scopes): every row's weights and metrics file equal to
// sequential's, the documented rows and roles, the caller's cost of a pending call recorded,
// and a row made to fail is reported.
TEST_F(BenchTool, OverlapRecordsEveryRowVerified) {
  const auto out =
      run_bench("overlap -N 3 --size 4 --steps 3 -T 2 --warmup 1 --no-progress --json " +
                path("overlap.json"));
  ASSERT_EQ(out.status, 0) << out.output;
  EXPECT_NE(out.output.find("3 steps: all 3 strategies match sequential before timing; bitwise "
                            "equal: sequential, scoped, submit (the final weights and the "
                            "metrics file)"),
            std::string::npos)
      << out.output;
  const json j = read_json(path("overlap.json"));
  EXPECT_EQ(j.at("config").at("workload"), "overlap");
  EXPECT_GT(j.at("config").at("pending_call_us").get<double>(), 0);
  std::set<std::string> seen;
  for (const auto& r : j.at("results")) {
    EXPECT_TRUE(r.at("verified").get<bool>()) << r.dump();
    EXPECT_EQ(r.at("role"), expected_role(r.at("strategy").get<std::string>())) << r.dump();
    seen.insert(r.at("strategy").get<std::string>());
  }
  EXPECT_EQ(seen,
            (std::set<std::string>{"sequential", "scoped", "submit", "decode-alone", "train-alone",
                                   "metrics-alone", "sum-of-parts", "max-of-parts"}));
  // This machine's floor, from the parts: none faster than alone, and no more work at once
  // than the cores do.
  std::map<std::string, double> ms;
  for (const auto& r : j.at("results"))
    ms[r.at("strategy").get<std::string>()] = r.at("mean_ms").get<double>();
  const double train = ms.at("train-alone"), decode = ms.at("decode-alone"),
               metrics = ms.at("metrics-alone");
  const auto cores = j.at("config").at("machine").at("cores").get<double>();
  const auto main_threads = j.at("config").at("train_threads").get<double>();
  const double want = std::max(
      {train, decode, metrics, (main_threads * train + decode + metrics) / std::max(1.0, cores)});
  EXPECT_NEAR(j.at("config").at("machine_floor_ms").get<double>(), want, 1e-12 * want);
  EXPECT_NE(out.output.find("overlap on this machine (" + std::to_string(static_cast<int>(cores)) +
                            " cores, " + std::to_string(static_cast<int>(main_threads)) +
                            " intra-op thread(s) on the main thread): floor"),
            std::string::npos)
      << out.output;
  const auto bad = run_bench(
      "overlap -N 2 --size 4 --steps 2 -T 1 --warmup 0 --no-progress --perturb-row scoped");
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_NE(bad.output.find("1 row not verified against sequential (overlap 2x4 scoped)"),
            std::string::npos)
      << bad.output;
}

// The allreduce workload on 2 local ranks: every row verified on every rank (the consolidated
// tree's buffer reduced as one bucket included) and the documented row names.
TEST_F(BenchTool, AllreduceOnTwoRanksVerifiesEveryRow) {
  const auto out = run_bench(
      "allreduce --models mobilenet_v3_small --compute-matmuls 1 -T 1 --warmup 0 --no-progress "
      "--json " +
      path("allreduce.json"));
  ASSERT_EQ(out.status, 0) << out.output;
  EXPECT_NE(out.output.find("every row, limit included, equal to the hand-computed sum"),
            std::string::npos)
      << out.output;
  const json j = read_json(path("allreduce.json"));
  std::set<std::string> seen;
  for (const auto& r : j.at("results")) {
    EXPECT_EQ(r.at("workload"), "allreduce");
    EXPECT_EQ(r.at("size"), "mobilenet_v3_small");
    EXPECT_TRUE(r.at("verified").get<bool>()) << r.dump();
    EXPECT_EQ(r.at("role"), expected_role(r.at("strategy").get<std::string>())) << r.dump();
    // compute moves no gradient bytes: no GB/s; every other row reduces them all.
    EXPECT_EQ(r.at("gbps").is_null(), r.at("strategy") == "compute") << r.dump();
    seen.insert(r.at("strategy").get<std::string>());
  }
  EXPECT_EQ(seen, (std::set<std::string>{"native", "tree", "consolidated", "limit", "tree+compute",
                                         "async", "compute"}));
  // The compute row times other work: the table claims no speed-up for it.
  EXPECT_NE(table_line(out.output, "mobilenet_v3_small", "compute").find("-    1  reference"),
            std::string::npos)
      << out.output;
  // The README's tables come from the JSON with the same roles (scripts/readme_tables.py).
  const auto md =
      tt_test::run_command("python3 " + std::string(TREETENSOR_SOURCE_DIR) +
                           "/scripts/readme_tables.py --print --out " + path("") + " 2>&1");
  ASSERT_EQ(md.status, 0) << md.output;
  EXPECT_NE(md.output.find("| mobilenet_v3_small | `compute` |"), std::string::npos) << md.output;
  EXPECT_NE(md.output.find("| (reference) |"), std::string::npos) << md.output;
  EXPECT_NE(md.output.find(" bound) |"), std::string::npos) << md.output;
  EXPECT_NE(md.output.find("**all_reduce over 2 local ranks** — `"), std::string::npos)
      << md.output;
}

// An unverified row never stops a run: every workload writes its table, JSON and plot, the
// row is marked and claims no speed-up, and the exit status (2) comes at the end with a line
// naming the rows.
TEST_F(BenchTool, UnverifiedRowIsMarkedAndEveryOutputIsStillWritten) {
  struct Run {
    std::string args, prefix, row_size;
  };
  const Run runs[] = {
      {"seed -N 4 -M 2 -T 1 --warmup 0 --sizes 4,8 --perturb-row stream", "seed", "8"},
      {"optimizer --model mobilenet_v3_small -T 1 --warmup 0 --perturb-row auto", "opt",
       "mobilenet_v3_small"}};
  for (const auto& run : runs) {
    SCOPED_TRACE(run.args);
    const auto out = run_bench(run.args + " --no-progress --json " + path(run.prefix + ".json") +
                               " --plot " + path(run.prefix + ".png"));
    EXPECT_EQ(out.status, 2) << out.output;
    const std::string strategy = run.prefix == "seed" ? "stream" : "auto";
    EXPECT_NE(out.output.find(": NOT VERIFIED; " + strategy + ": '"), std::string::npos)
        << out.output;
    EXPECT_NE(out.output.find("times the rounding bound at element"), std::string::npos);
    const std::string workload = run.prefix == "seed" ? "seed" : "optimizer";
    const std::string summary = run.prefix == "seed"
                                    ? "treetensor-bench: 2 rows not verified against native "
                                      "(seed 4 stream, seed 8 stream)"
                                    : "treetensor-bench: 1 row not verified against native "
                                      "(optimizer mobilenet_v3_small auto)";
    EXPECT_NE(out.output.find(summary), std::string::npos) << out.output;
    const json j = read_json(path(run.prefix + ".json"));
    EXPECT_FALSE(j.at("config").at("all_verified").get<bool>());
    std::size_t unverified = 0;
    for (const auto& r : j.at("results")) {
      const bool bad = r.at("strategy") == strategy;
      EXPECT_EQ(r.at("verified").get<bool>(), !bad) << r.dump();
      EXPECT_EQ(r.at("speedup_vs_native").is_null(), bad) << r.dump();
      unverified += bad;
    }
    EXPECT_EQ(unverified, run.prefix == "seed" ? 2u : 1u);
    EXPECT_NE(out.output.find("-    1  NO"), std::string::npos) << "table row: no speed-up, NO";
    if (std::system("command -v gnuplot >/dev/null 2>&1") == 0)
      EXPECT_GT(fs::file_size(path(run.prefix + ".png")), 0u);
  }
}

// A real checkpoint written by Python: its floating tensors other than batch-norm buffers.
TEST_F(BenchTool, OptimizerOverARealCheckpoint) {
  const std::string file = std::string(TREETENSOR_IO_FIXTURES) + "/module_state.pt";
  const auto out = run_bench("optimizer --checkpoint " + file +
                             " -T 1 --warmup 0 --no-progress --json " + path("ckpt.json"));
  ASSERT_EQ(out.status, 0) << out.output;
  EXPECT_NE(out.output.find("Adam step over " + file), std::string::npos) << out.output;
  const json j = read_json(path("ckpt.json"));
  EXPECT_EQ(j.at("config").at("model"), "module_state.pt");
  EXPECT_EQ(j.at("config").at("trainable_tensors"), 6);  // conv, bn, fc: weight and bias
  EXPECT_EQ(j.at("config").at("skipped_buffers"), 3);    // running_mean/var, num_batches_tracked
  EXPECT_EQ(j.at("config").at("trainable_elements"), 54 + 3 + 3 + 3 + 24 + 2);
  for (const auto& r : j.at("results")) EXPECT_TRUE(r.at("verified").get<bool>()) << r.dump();
  const auto bad = run_bench("optimizer --checkpoint " + path("missing.pt"));
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("File does not exist"), std::string::npos) << bad.output;
}

TEST_F(BenchTool, HelpExplainsEveryRowAndFlag) {
  const auto seed = run_bench("seed --help");
  ASSERT_EQ(seed.status, 0);
  for (const char* word : {"min ",          "native ",  "native-discard",
                           "linear ",       "stream ",  "auto ",
                           "fused ",        "--leaves", "--lanes",
                           "--reps",        "--warmup", "--sizes",
                           "--s1",          "--s2",     "--s3",
                           "--dtype",       "--device", "--seed",
                           "--json",        "--plot",   "--caching-allocator",
                           "--no-progress", "GFLOP/s"})
    EXPECT_NE(seed.output.find(word), std::string::npos) << word;
  const auto opt = run_bench("optimizer --help");
  ASSERT_EQ(opt.status, 0);
  for (const char* word : {"native ", "flat ", "limit ", "foreach ", "linear ", "stream ", "auto ",
                           "fused ", "--model", "--lr", "--weight-decay", "running_mean"})
    EXPECT_NE(opt.output.find(word), std::string::npos) << word;
}

TEST_F(BenchTool, BadInputGivesAClearErrorAndNoCrash) {
  auto out = run_bench("optimizer --model no_such_model");
  EXPECT_NE(out.status, 0);
  EXPECT_LT(out.status, 128) << "crashed: " << out.output;
  EXPECT_NE(out.output.find("no_such_model"), std::string::npos) << out.output;

  out = run_bench("seed -N 2 -M 4");
  EXPECT_NE(out.status, 0);
  EXPECT_NE(out.output.find("must not exceed N"), std::string::npos) << out.output;

  std::ofstream(path("bad.json")) << R"({"model": "x", "tensors": [{"key": "w"}]})";
  out = run_bench("optimizer --no-progress --model " + path("bad.json"));
  EXPECT_EQ(out.status, 1) << out.output;
  EXPECT_NE(out.output.find("does not match"), std::string::npos) << out.output;

  // Without CUDA: a clear error; with CUDA: a tiny run that verifies.
  out = run_bench("seed --device cuda -N 2 -M 1 -T 1 --warmup 1 --sizes 4 --no-progress");
  if (out.output.find("has no CUDA") != std::string::npos)
    EXPECT_EQ(out.status, 1) << out.output;
  else
    EXPECT_EQ(out.status, 0) << out.output;

  out = run_bench("seed --device tpu");
  EXPECT_NE(out.status, 0);
  EXPECT_LT(out.status, 128) << "crashed: " << out.output;
}

// Out-of-range counts and sizes say what was expected, not CLI11's "not in range 0.000000 to
// 1797693134862315708145...".
TEST_F(BenchTool, RangeErrorsAreReadable) {
  const std::pair<const char*, const char*> cases[] = {
      {"seed -T 0", "--reps: must be an integer >= 1, got '0'"},
      {"optimizer -T 0", "--reps: must be an integer >= 1, got '0'"},
      {"seed -N 0", "--leaves: must be an integer >= 1, got '0'"},
      {"seed -N -3", "--leaves: must be an integer >= 1, got '-3'"},
      {"seed --sizes 4,-5", "--sizes: must be an integer >= 1, got '-5'"},
      {"seed --sizes 4,x", "--sizes: must be an integer >= 1, got 'x'"},
      {"seed --s1 0", "--s1: must be an integer >= 1, got '0'"},
      {"seed --s1 4 --s2 0", "--s2: must be an integer >= 1, got '0'"},
      {"seed --s1 4 --s3 2.5", "--s3: must be an integer >= 1, got '2.5'"}};
  for (const auto& [args, message] : cases) {
    const auto out = run_bench(args);
    EXPECT_NE(out.status, 0) << args;
    EXPECT_LT(out.status, 128) << args << " crashed: " << out.output;
    EXPECT_NE(out.output.find(message), std::string::npos) << args << "\n" << out.output;
    EXPECT_EQ(out.output.find("not in range"), std::string::npos) << args << "\n" << out.output;
    EXPECT_EQ(out.output.find("machine:"), std::string::npos) << args << " ran:\n" << out.output;
  }
}

// The plot is PNG, so --plot takes only a .png name (any case).
TEST_F(BenchTool, PlotNeedsAPngName) {
  for (const char* name : {"x.txt", "x", "x.png.txt"}) {
    const auto out = run_bench(std::string("seed --no-progress --plot ") + path(name));
    EXPECT_NE(out.status, 0) << name;
    EXPECT_LT(out.status, 128) << name << " crashed: " << out.output;
    EXPECT_NE(out.output.find("--plot: the plot is a PNG image: give a file name ending in .png, "
                              "got '" +
                              path(name) + "'"),
              std::string::npos)
        << out.output;
    EXPECT_EQ(out.output.find("machine:"), std::string::npos) << name << " ran:\n" << out.output;
  }
  const auto out = run_bench("seed -N 2 -M 1 -T 1 --warmup 0 --sizes 4 --no-progress --plot " +
                             path("UPPER.PNG"));
  EXPECT_EQ(out.status, 0) << out.output;
}

// A --json or --plot path that cannot be written fails at once (exit 1, naming flag and path),
// before the headline and any measuring; gnuplot never gets to fall back to stdout.
TEST_F(BenchTool, OutputPathsAreCheckedBeforeMeasuring) {
  const std::string missing = path("no_such_dir") + "/x";
  const std::pair<std::string, std::string> cases[] = {
      {"--plot " + missing + ".png",
       "--plot " + missing + ".png: directory '" + path("no_such_dir") + "' does not exist"},
      {"--json " + missing + ".json",
       "--json " + missing + ".json: directory '" + path("no_such_dir") + "' does not exist"},
      {"--json " + dir_.string(), "--json " + dir_.string() + ": is a directory; give a file name"},
      {"--json " + path("ok.json") + " --plot " + path("dir.png"),
       "--plot " + path("dir.png") + ": is a directory; give a file name"}};
  fs::create_directories(path("dir.png"));
  for (const auto& [args, message] : cases) {
    const auto out = run_bench("seed -N 2 -M 1 -T 1 --warmup 0 --sizes 4 --no-progress " + args);
    EXPECT_EQ(out.status, 1) << args << "\n" << out.output;
    EXPECT_NE(out.output.find(message), std::string::npos) << args << "\n" << out.output;
    EXPECT_EQ(out.output.find("machine:"), std::string::npos) << args << " ran:\n" << out.output;
    EXPECT_EQ(out.output.find("PNG"), std::string::npos) << args;
    EXPECT_LT(out.output.size(), 1000u) << args << "\n" << out.output;
  }
  EXPECT_FALSE(fs::exists(path("ok.json"))) << "wrote --json although --plot was bad";
}

// Whatever gnuplot prints on stdout (it falls back there when it cannot open the output) never
// reaches the tool's stdout, and a plot gnuplot did not write is an error, even when a file of
// that name is left from an earlier run. A stand-in gnuplot on PATH prints and writes nothing.
TEST_F(BenchTool, GnuplotOutputNeverReachesStdout) {
  fs::create_directories(path("bin"));
  const std::string fake = path("bin") + "/gnuplot";
  std::ofstream(fake) << "#!/bin/sh\n"
                         "[ \"$1\" = -e ] && exit 0\n"  // "set terminal pngcairo" works
                         "cat >/dev/null\n"
                         "echo FAKE-GNUPLOT-STDOUT\n"
                         "exit 0\n";
  fs::permissions(fake, fs::perms::owner_all);
  std::ofstream(path("old.png")) << "an earlier run's plot";
  const auto faked = run_bench_with_prefix(
      "PATH=" + path("bin") + ":\"$PATH\" ",
      "seed -N 2 -M 1 -T 1 --warmup 0 --sizes 4 --no-progress --plot " + path("old.png"));
  EXPECT_EQ(faked.status, 1) << faked.output;
  EXPECT_NE(faked.output.find("gnuplot did not write '" + path("old.png") + "'"), std::string::npos)
      << faked.output;
  EXPECT_EQ(faked.output.find("FAKE-GNUPLOT-STDOUT"), std::string::npos) << faked.output;
  EXPECT_NE(faked.output.find("native"), std::string::npos) << "the table comes first:\n"
                                                            << faked.output;
}

}  // namespace
