#pragma once
// treetensor-bench settings and their command line (CLI11).

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace treetensor::bench {

/// One seed leaf size: leaf i computes an s1×s2 @ s2×s3 matmul.
struct SeedSize {
  std::int64_t s1 = 0, s2 = 0, s3 = 0;
  /// True when (s1, s2, s3) = (S, 2S, 4S), the sweep's shape; then label() is "S".
  bool is_sweep_shape() const { return s2 == 2 * s1 && s3 == 4 * s1; }
  /// "64" for a sweep shape, else "s1x s2 x s3" as "64x100x7".
  std::string label() const;
  /// Floating-point operations of one leaf's matmul: 2·s1·s2·s3.
  double leaf_flops() const { return 2.0 * double(s1) * double(s2) * double(s3); }
};

/// Adam hyper-parameters (PyTorch's torch.optim.Adam / torch::optim::AdamOptions names).
struct AdamSettings {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

enum class Workload { seed, optimizer, elementwise, allreduce, overlap };

inline constexpr std::size_t kAutoRepsMin = 10, kAutoRepsMax = 100;
/// elementwise and seed: the shortest timed sample, in ms (RepPlan::min_sample_ms): their
/// calls of microseconds are timed in batches, so that one preempted call is not a sample.
inline constexpr double kMinSampleMs = 5.0;

/// Every setting of one run; filled by parse_command_line() with device-dependent defaults.
struct Config {
  Workload workload = Workload::seed;
  std::size_t leaves = 200;  ///< N (seed)
  std::size_t lanes = 2;     ///< M for the stream row and the min row
  /// T: timed repetitions per strategy; 0 means automatic: per size, as many as fit in
  /// about `rep_budget_s` seconds (judged from the last warm-up), between kAutoRepsMin and
  /// kAutoRepsMax.
  std::size_t reps = 0;
  double rep_budget_s = 6.0;
  /// Untimed repetitions per strategy first: 8 lets stream(automatic) finish its one-time
  /// trial of each strategy (two calls each), so every row shows the steady state.
  std::size_t warmup = 8;
  std::vector<SeedSize> sizes;  ///< seed sizes, in sweep order
  c10::ScalarType dtype = c10::kFloat;
  c10::Device device = c10::Device(c10::kCPU);
  std::uint64_t seed = 0;          ///< random seed of the inputs
  std::string model = "resnet50";  ///< optimizer: a name in data/models or a .json path
  std::string model_path;          ///< resolved path of the model file
  std::string checkpoint;          ///< optimizer: a checkpoint file instead of a model
  AdamSettings adam;
  std::vector<std::size_t> elementwise_leaves = {200, 2000};         ///< elementwise: N grid
  std::vector<std::int64_t> elementwise_elements = {4, 256, 65536};  ///< elementwise: E grid
  double elementwise_budget_s = 0.5;     ///< elementwise: automatic-T budget per (N, E, op)
  std::optional<std::string> json_path;  ///< --json FILE
  std::optional<std::string> plot_path;  ///< --plot FILE.png
  bool progress = true;                  ///< progress line on stderr
  bool caching_allocator = false;        ///< install treetensor's caching CPU allocator
  std::string command_line;              ///< argv joined, recorded in the JSON
  /// allreduce: the models whose gradient trees are all-reduced (names in data/models), and
  /// their resolved paths.
  std::vector<std::string> models = {"mobilenet_v3_small", "resnet50"};
  std::vector<std::string> model_paths;
  int ranks = 2;                    ///< allreduce: local ranks started (the launcher)
  std::size_t compute_matmuls = 8;  ///< allreduce: 384x384 matmuls of the main thread's work
  std::size_t overlap_leaves = 40;  ///< overlap: N leaves of every tree
  std::int64_t overlap_size = 64;   ///< overlap: S (the seed's S x 2S @ 2S x 4S matmul)
  /// overlap: training steps per timed repetition; enough that the pipeline's fill and drain
  /// (the first decode and the last metrics, which nothing overlaps) are a small share of it.
  std::size_t overlap_steps = 32;
  /// overlap: intra-op threads of the main thread (default: cores - 1, so that a core is free
  /// for the asyncs threads).
  std::size_t overlap_train_threads = 1;
  std::string
      perturb_row;  ///< --perturb-row: a strategy whose results are made to fail verification
};

/// Parses argv into a Config, applying the CPU or CUDA defaults for what was not given.
/// @returns the Config, or std::nullopt after printing --help or a usage error; `exit_code`
///          then holds the code main() should return (0 for --help, non-zero for errors).
/// Thread safety: not thread-safe (CLI11 state); call once from main().
std::optional<Config> parse_command_line(int argc, char** argv, int& exit_code);

/// "float32", "float64", "float16", "bfloat16" for the supported dtypes.
std::string dtype_name(c10::ScalarType t);

}  // namespace treetensor::bench
