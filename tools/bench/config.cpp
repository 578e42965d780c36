#include "config.hpp"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <filesystem>
#include <iostream>
#include <map>
#include <thread>

#ifndef TREETENSOR_DATA_DIR
#define TREETENSOR_DATA_DIR "data"
#endif

namespace treetensor::bench {
namespace {

const std::map<std::string, c10::ScalarType> kDtypes = {{"float32", c10::kFloat},
                                                        {"float64", c10::kDouble},
                                                        {"float16", c10::kHalf},
                                                        {"bfloat16", c10::kBFloat16}};

constexpr const char* kSeedRows =
    R"(Rows (one per strategy and size; every row is checked against `native` before timing):
  min             the tree call (linear) on N/M leaves: the time a perfect M-way split of
                  the N leaves could reach. Its GFLOP/s counts all N leaves, so it reads as
                  the throughput of that ideal split.
  native          a hand-written loop over std::map<std::string, at::Tensor> that keeps
                  every result in a new map, as a tree call does. The baseline of every
                  speed-up.
  native-discard  the seed's own loop, which throws each result away (no new memory stays
                  alive). For reference only; never a baseline.
  linear          the tree call under stream(1): every leaf on the calling thread.
  stream          the tree call under stream(M): leaves spread over M lanes.
  auto            the tree call under stream(automatic): the policy picks linear, lanes or
                  fused per call.
  fused           the tree call under stream(fused): one bmm over the stacked leaves when
                  shapes allow (all leaves share a shape here).
Columns: mean and standard deviation of the T timed repetitions (ms), GFLOP/s =
2*S1*S2*S3*N / mean time, speed-up = native mean / row mean, T = repetitions timed,
verified = every result within the matmul rounding bound of native's,
|C - C_native| <= 2(gamma_K + u)(|A| @ |B|) elementwise (a lane runs OpenBLAS with one thread,
native with all, so the summation order may differ); the note above the table says which rows
are bitwise equal and, for the others, the worst ratio to that bound. An unverified row shows
"NO", has no speed-up ("-", null in the JSON), is left out of the plot, and makes the exit
status 2 once every output is written.
Timing: strategies run round-robin within each repetition (the order rotates each
repetition) so that noise from a shared machine hits all of them alike; in a repetition a
row's sample is the mean of back-to-back calls that take at least 5 ms at the warm-up's pace
(the JSON's `calls`; one call without warm-up), each call replacing the previous result; the
last result is kept until the clock stops, then released outside the timed region; with
--device cuda the device is synchronized after every sample. TREETENSOR_LOG_POLICY=1 prints each
automatic decision (and why) on stderr.)";

constexpr const char* kOptimizerRows =
    R"(One Adam step (with bias correction and L2 weight decay, PyTorch's torch.optim.Adam
arithmetic) over the trainable parameters of a real model: four trees (parameters,
gradients, first and second moments) built from the shapes in data/models/<model>.json.
Only weights and biases take part, not running_mean / running_var / num_batches_tracked
(resnet50: 161 tensors, 25,557,032 elements; mobilenet_v3_small: 142, 2,542,856).
Rows (each checked against `native` before timing: the updated parameters bitwise equal for
the at:: strategies, which do the same elementwise arithmetic per element; `flat` within the
Adam step's rounding bound, treetensor/tensor/rounding.hpp):
  native   a loop of per-tensor at:: ops, as a hand-written LibTorch optimizer does
           (torch::optim::Adam's arithmetic). The baseline of every speed-up.
  flat     consolidated trees (one buffer each for params, grads, moments) and the
           single-pass kernel (adam_step_single_pass), pieces spread as stream(automatic)
           decides.
  limit    the memory-bandwidth floor measured in the same run: one streaming pass reading
           16 and writing 12 bytes per element over the same buffers and pieces (no Adam
           arithmetic; not verified).
  foreach  at::_foreach_* over the flat tensor lists, as PyTorch's own optimizer does
           (foreach=True).
  linear   the tree Adam step under stream(1).
  stream   the tree Adam step under stream(M).
  auto     the tree Adam step under stream(automatic).
  auto-consolidated  the same on consolidated trees: each stage one call per buffer (flat).
  fused    the tree Adam step under stream(fused): batched (_foreach_) arithmetic.
Columns: mean and standard deviation of T timed steps (ms), GFLOP/s (null: not meaningful for
a memory-bound update), speed-up = native mean / row mean, T = steps timed, verified. Strategies take turns
within each repetition on one shared state, so the step count keeps advancing.)";

constexpr const char* kAllreduceRows =
    R"(The gradient tree of each model (its trainable tensors' shapes from data/models/<model>.json,
float32) all-reduced (sum) across local ranks started by the built-in launcher (Gloo over
loopback; rank 0 reports; each rank runs its kernels with one intra-op thread). Every rank
starts from its own integer-valued gradients, so the sums are exact; every row's result is
compared bitwise with the hand-computed sum on every rank before timing.
Rows:
  native        one c10d allreduce per tensor, issued and waited one after another, as a
                hand-written loop over torch.distributed.all_reduce does. The baseline.
  tree          distributed::all_reduce of the tree: DDP-style buckets (1 MiB, then 25 MiB),
                ordered across ranks by the group's communication thread.
  consolidated  distributed::all_reduce of a consolidated copy of the tree: its buffer is the
                bucket (one allreduce, nothing packed or copied back).
  limit         one allreduce of one pre-flattened buffer of the same size (the floor: no
                packing, one call).
  tree+compute  tree, then the main thread's work (--compute-matmuls 384x384 matmuls), one
                after the other.
  async         the tree all_reduce submitted to an asyncs thread while the main thread does
                the same work; timed until both are done (overlap: compare with tree+compute).
  compute       the main thread's work alone (no communication; nothing to verify).
Columns: mean and standard deviation of T timed repetitions on rank 0 (ms), speed-up = native
mean / row mean, T, verified (on every rank). The gradients are restored outside the timed
region after every repetition. T is the same on every rank (default 10; the automatic plan is
not used, as ranks must run the same collectives).)";

constexpr const char* kOverlapRows =
    R"(The seed's loop as OneFlow's asyncs PR writes it (DESIGN.md §10, pending scopes). Each step:
  decode   the next batch (S x 2S per leaf) from N leaves of S x S uint8 codes: to float,
           centre, @ an S x 2S projection (a quarter of the training step's flops);
  train    the seed's matmul (batch S x 2S @ weights 2S x 4S per leaf) and an in-place weight
           update (w *= 0.9999), on the main thread;
  metrics  per-leaf std and norm of the step's output, written to a file (a line per step).
Rows (each checked before timing: the final weights and the metrics file bitwise equal to
sequential's):
  sequential     all three on the main thread, one after another. The baseline.
  scoped         decode inside `ThreadScope(decoder)` and metrics inside `ThreadScope(metrics)`
                 (pending: the calls return at once, the main thread goes on to train); the file
                 write is a job on the metrics thread. Reading the batch waits for its decode.
  submit         the same overlap by hand: Thread::submit for decode and for metrics.
  decode-alone, train-alone, metrics-alone   each part alone (references);
  sum-of-parts   their sum (what sequential should cost);
  max-of-parts   the largest (the floor of a perfect overlap when each part has a core of its
                 own; the goal is scoped <= 1.15x it). The notes also give this machine's
                 floor: no part faster than alone, and no more work at once than the
                 cores can do (train x its intra-op threads, decode and metrics 1 each).
Columns: milliseconds per step (mean and standard deviation over T repetitions of --steps
steps), speed-up = sequential / row. The main thread runs --train-threads intra-op threads; the
asyncs threads one each. The notes also give the caller's cost of one pending call.)";

// An integer >= 1. CLI::PositiveNumber would print "Value 0 not in range 0.000000 to
// 179769313486231570814527...", unreadable; CLI11 prefixes this message with the flag's name.
const CLI::Validator kAtLeastOne(
    [](std::string& text) -> std::string {
      std::int64_t v = 0;
      const char* end = text.data() + text.size();
      const auto [ptr, ec] = std::from_chars(text.data(), end, v);
      if (ec != std::errc() || ptr != end || v < 1)
        return "must be an integer >= 1, got '" + text + "'";
      return "";
    },
    ">=1");

// The plot is always PNG (gnuplot's png/pngcairo terminal), so the name must say so.
const CLI::Validator kPngFile(
    [](std::string& text) -> std::string {
      std::string ext = std::filesystem::path(text).extension().string();
      std::transform(ext.begin(), ext.end(), ext.begin(),
                     [](unsigned char c) { return std::tolower(c); });
      if (ext != ".png")
        return "the plot is a PNG image: give a file name ending in .png, got '" + text + "'";
      return "";
    },
    "");

// `reps_default`: the -T help's words for the workload's default; `lanes_help`: what -M does
// in it.
void add_common(CLI::App& sub, Config& cfg, std::string& dtype, std::string& device,
                const std::string& reps_default,
                const std::string& lanes_help =
                    "M: lanes of the `stream` row; `min` uses N/M "
                    "leaves") {
  sub.add_option("-M,--lanes", cfg.lanes, lanes_help)
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  sub.add_option("-T,--reps", cfg.reps,
                 "T: timed repetitions per strategy (default: " + reps_default + ")")
      ->check(kAtLeastOne);
  sub.add_option("--warmup", cfg.warmup,
                 "untimed repetitions per strategy before timing (enough for automatic to try "
                 "each strategy once per call shape, so its row is the steady state)")
      ->capture_default_str();
  sub.add_option("--dtype", dtype, "element type of every tensor")
      ->check(CLI::IsMember({"float32", "float64", "float16", "bfloat16"}))
      ->capture_default_str();
  sub.add_option("--device", device,
                 "where tensors live: cpu, cuda or cuda:K (needs a CUDA build of LibTorch)")
      ->type_name("DEVICE")
      ->capture_default_str();
  sub.add_option("--seed", cfg.seed, "random seed of the inputs")->capture_default_str();
  sub.add_option("--json", cfg.json_path,
                 "write {config, results} to FILE; results are records {workload, strategy, "
                 "size, mean_ms, std_ms, gflops, speedup_vs_native, verified}")
      ->type_name("FILE");
  sub.add_option("--plot", cfg.plot_path,
                 "draw speed-up vs native against leaf size, one line per strategy, into "
                 "FILE.png (needs gnuplot: sudo apt-get install gnuplot-nox)")
      ->type_name("FILE.png")
      ->check(kPngFile);
  sub.add_flag(
      "--no-progress", [&cfg](std::int64_t) { cfg.progress = false; },
      "no progress line on stderr");
  sub.add_option("--perturb-row", cfg.perturb_row,
                 "change one element of ROW's first result by 1e-3 relative before verifying "
                 "it (tests the report of an unverified row; never for measurements)")
      ->type_name("ROW");
  sub.add_flag("--caching-allocator", cfg.caching_allocator,
               "install treetensor's caching CPU allocator before making inputs (every row "
               "then allocates through it; TREETENSOR_CACHING_CPU_ALLOCATOR=1 does the same "
               "from the first tree call)");
}

std::string resolve_model(const std::string& model) {
  namespace fs = std::filesystem;
  if (model.ends_with(".json") || model.find('/') != std::string::npos) return model;
  for (const fs::path& dir : {fs::path("data/models"), fs::path(TREETENSOR_DATA_DIR) / "models"}) {
    fs::path p = dir / (model + ".json");
    if (fs::exists(p)) return p.string();
  }
  throw CLI::ValidationError("--model", "no model file '" + model + ".json' in ./data/models or " +
                                            TREETENSOR_DATA_DIR +
                                            "/models; give a name there "
                                            "(resnet50, mobilenet_v3_small) or a path to a .json");
}

std::vector<SeedSize> sweep(const std::vector<std::int64_t>& s) {
  std::vector<SeedSize> out;
  for (auto v : s) out.push_back({v, 2 * v, 4 * v});
  return out;
}

}  // namespace

std::string SeedSize::label() const {
  if (is_sweep_shape()) return std::to_string(s1);
  return std::to_string(s1) + "x" + std::to_string(s2) + "x" + std::to_string(s3);
}

std::string dtype_name(c10::ScalarType t) {
  for (const auto& [name, type] : kDtypes)
    if (type == t) return name;
  return c10::toString(t);
}

std::optional<Config> parse_command_line(int argc, char** argv, int& exit_code) {
  Config cfg;
  std::string dtype = "float32", device = "cpu";
  std::vector<std::int64_t> sizes = {16, 32, 64, 128};
  std::int64_t s1 = 0, s2 = 0, s3 = 0;

  CLI::App app{
      "treetensor-bench: does tree-level parallelism pay on your sizes, and which "
      "strategy wins? Every figure is measured side by side in one run.",
      "treetensor-bench"};
  app.require_subcommand(1);
  app.footer(
      "Examples:\n  treetensor-bench seed --json out/seed.json --plot out/seed.png\n"
      "  treetensor-bench optimizer --model resnet50 --json out/optimizer.json\n"
      "  treetensor-bench seed --device cuda      # the seed's own sizes on a GPU\n"
      "  treetensor-bench allreduce --json out/allreduce.json   # 2 local ranks\n"
      "  treetensor-bench elementwise --json out/elementwise.json\n"
      "  treetensor-bench overlap --json out/overlap.json\n"
      "Run `treetensor-bench <workload> --help` (seed, optimizer, elementwise, allreduce, overlap) "
      "for its "
      "rows and flags.");

  CLI::App* seed = app.add_subcommand(
      "seed",
      "N leaves a0..a{N-1}; leaf i multiplies S1xS2 by S2xS3 (DI-treetensor's stream "
      "experiment), over a size sweep");
  const std::string per_size =
      "on CPU per size, as many as fit in about 6 s, 10 to 100; 50 with --device cuda";
  add_common(*seed, cfg, dtype, device, per_size);
  seed->add_option("-N,--leaves", cfg.leaves, "N: number of leaves (default 200)")
      ->check(kAtLeastOne);
  auto* sizes_opt = seed->add_option("--sizes", sizes,
                                     "sweep of S, comma-separated: S1=S, S2=2S, S3=4S (default "
                                     "16,32,64,128 on CPU, 512 with "
                                     "--device cuda)")
                        ->delimiter(',')
                        ->check(kAtLeastOne);
  seed->add_option("--s1", s1, "one explicit size instead of the sweep: rows of the left factor")
      ->check(kAtLeastOne)
      ->excludes(sizes_opt);
  seed->add_option("--s2", s2, "inner dimension (default 2*S1); needs --s1")
      ->check(kAtLeastOne)
      ->excludes(sizes_opt);
  seed->add_option("--s3", s3, "columns of the right factor (default 4*S1); needs --s1")
      ->check(kAtLeastOne)
      ->excludes(sizes_opt);
  seed->footer(kSeedRows);

  CLI::App* opt = app.add_subcommand(
      "optimizer", "one Adam step over the parameter tree of a real model (torchvision shapes)");
  add_common(*opt, cfg, dtype, device, per_size);
  opt->add_option("--model", cfg.model,
                  "resnet50, mobilenet_v3_small (a file in data/models) or a path to a shapes "
                  ".json {model, source, tensors: [{key, shape, dtype}]}")
      ->type_name("NAME|FILE")
      ->capture_default_str();
  opt->add_option("--checkpoint", cfg.checkpoint,
                  "instead of --model: a real checkpoint file (torch.save .pt/.pth or "
                  ".safetensors); its floating tensors other than batch-norm buffers are the "
                  "parameters, starting from their stored values")
      ->type_name("FILE")
      ->check(CLI::ExistingFile);
  opt->add_option("--lr", cfg.adam.lr, "Adam learning rate")->capture_default_str();
  opt->add_option("--beta1", cfg.adam.beta1, "Adam beta1")->capture_default_str();
  opt->add_option("--beta2", cfg.adam.beta2, "Adam beta2")->capture_default_str();
  opt->add_option("--eps", cfg.adam.eps, "Adam eps")->capture_default_str();
  opt->add_option("--weight-decay", cfg.adam.weight_decay, "Adam L2 weight decay")
      ->capture_default_str();
  opt->footer(kOptimizerRows);
  CLI::App* ar = app.add_subcommand(
      "allreduce",
      "all_reduce of the gradient trees of real models across local ranks (c10d Gloo)");
  add_common(*ar, cfg, dtype, device, "10; every rank runs the same number",
             "unused (no row runs lanes); accepted so that bench.sh passes one set of flags");
  ar->add_option("--models", cfg.models, "models whose gradient trees are reduced, comma-separated")
      ->delimiter(',')
      ->capture_default_str();
  ar->add_option("--ranks", cfg.ranks, "local ranks to start")
      ->check(CLI::Range(2, 8))
      ->capture_default_str();
  ar->add_option("--compute-matmuls", cfg.compute_matmuls,
                 "the main thread's work in the tree+compute, async and compute rows: this many "
                 "384x384 float32 matmuls")
      ->capture_default_str();
  ar->footer(kAllreduceRows);

  CLI::App* ew = app.add_subcommand(
      "elementwise",
      "N leaves x E elements: add and (x*2+y).sigmoid_(), per leaf against flat execution on "
      "consolidated trees");
  add_common(*ew, cfg, dtype, device,
             "per (N, E, op) as many as fit in --budget seconds, 10 to 100; where one round "
             "takes longer, at least 3 after 2 warm-up");
  ew->add_option("--leaves", cfg.elementwise_leaves, "grid of N, comma-separated")
      ->delimiter(',')
      ->check(kAtLeastOne)
      ->capture_default_str();
  ew->add_option("--elements", cfg.elementwise_elements, "grid of E, comma-separated")
      ->delimiter(',')
      ->check(kAtLeastOne)
      ->capture_default_str();
  ew->add_option("--budget", cfg.elementwise_budget_s,
                 "seconds per (N, E, op) for the automatic T (without -T)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  ew->footer(
      "Rows:\n  native     a std::map loop of at:: calls, as a hand-written LibTorch program\n"
      "  linear, stream, auto   the tree op per leaf under stream(1), stream(M), automatic\n"
      "  flat       consolidated trees: one ATen call per buffer; result leaves not made\n"
      "  flat+read  flat, then every result leaf made (and read) once\n"
      "  fused      the op's lambda through fuse() on the consolidated trees, automatic\n"
      "  one-call   one ATen call over a tensor of all N*E elements: the floor");

  CLI::App* ov = app.add_subcommand(
      "overlap",
      "the seed's loop with asyncs scopes: a training step on the main thread, a decoder and a "
      "metrics writer in pending scopes beside it");
  add_common(*ov, cfg, dtype, device, per_size,
             "unused (no row runs lanes); accepted so that bench.sh passes one set of flags");
  ov->add_option("-N,--leaves", cfg.overlap_leaves, "N: leaves of every tree")
      ->check(kAtLeastOne)
      ->capture_default_str();
  ov->add_option("--size", cfg.overlap_size,
                 "S: the training step multiplies S x 2S by 2S x 4S per leaf (the seed's shape)")
      ->check(kAtLeastOne)
      ->capture_default_str();
  ov->add_option("--steps", cfg.overlap_steps, "training steps per timed repetition")
      ->check(kAtLeastOne)
      ->capture_default_str();
  auto* train_threads =
      ov->add_option("--train-threads", cfg.overlap_train_threads,
                     "intra-op threads of the main thread (default: cores - 1, at least 1, so "
                     "that a core is free for the asyncs threads)")
          ->check(kAtLeastOne);
  ov->footer(kOverlapRows);

  try {
    app.parse(argc, argv);
    cfg.workload = seed->parsed()  ? Workload::seed
                   : opt->parsed() ? Workload::optimizer
                   : ew->parsed()  ? Workload::elementwise
                   : ov->parsed()  ? Workload::overlap
                                   : Workload::allreduce;
    if (ov->parsed() && train_threads->count() == 0)
      cfg.overlap_train_threads = std::max(1u, std::thread::hardware_concurrency()) > 1
                                      ? std::thread::hardware_concurrency() - 1
                                      : 1;
    cfg.dtype = kDtypes.at(dtype);
    try {
      cfg.device = c10::Device(device);
    } catch (const std::exception&) {
      throw CLI::ValidationError("--device", "expected cpu, cuda or cuda:K, got '" + device + "'");
    }
    const bool cuda = cfg.device.is_cuda();
    CLI::App* sub = seed->parsed()  ? seed
                    : opt->parsed() ? opt
                    : ew->parsed()  ? ew
                    : ov->parsed()  ? ov
                                    : ar;
    if (sub->get_option("--reps")->count() == 0 && cuda) cfg.reps = 50;
    if (sub->get_option("--warmup")->count() == 0 && cuda) cfg.warmup = 5;
    if (cfg.reps == 0 && cfg.warmup == 0)
      throw CLI::ValidationError("--warmup",
                                 "0 needs an explicit -T: the automatic T is judged "
                                 "from the warm-up");
    if (cfg.workload == Workload::seed) {
      if (s1 > 0) {
        cfg.sizes = {{s1, s2 > 0 ? s2 : 2 * s1, s3 > 0 ? s3 : 4 * s1}};
      } else if (s2 > 0 || s3 > 0) {
        throw CLI::ValidationError("--s2/--s3", "need --s1 as well");
      } else {
        cfg.sizes = sweep(sizes_opt->count() == 0 && cuda ? std::vector<std::int64_t>{512} : sizes);
      }
      if (cfg.lanes > cfg.leaves)
        throw CLI::ValidationError("--lanes", "M (" + std::to_string(cfg.lanes) +
                                                  ") must not exceed N (" +
                                                  std::to_string(cfg.leaves) + ")");
    } else if (cfg.workload == Workload::overlap) {
      if (cuda) throw CLI::ValidationError("--device", "overlap runs on CPU");
    } else if (cfg.workload == Workload::allreduce) {
      if (cuda) throw CLI::ValidationError("--device", "allreduce runs on CPU (Gloo)");
      // Every rank must run the same number of collectives: no automatic plan.
      if (cfg.reps == 0) cfg.reps = 10;
      for (const auto& m : cfg.models) cfg.model_paths.push_back(resolve_model(m));
    } else if (cfg.workload == Workload::optimizer && cfg.checkpoint.empty()) {
      cfg.model_path = resolve_model(cfg.model);
    }
  } catch (const CLI::ParseError& e) {
    exit_code = app.exit(e);
    return std::nullopt;
  }
  for (int i = 0; i < argc; ++i) cfg.command_line += (i ? " " : "") + std::string(argv[i]);
  return cfg;
}

}  // namespace treetensor::bench
