#pragma once
// The two workloads of treetensor-bench.

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "config.hpp"
#include "report.hpp"
#include "timing.hpp"
#include "treetensor/tensor/rounding.hpp"

namespace treetensor::bench {

/// What a workload measured: one record per strategy and size, the JSON config entries that
/// describe it, and the verification lines for the output.
struct WorkloadResult {
  std::vector<Record> records;
  nlohmann::json config;  ///< workload-specific settings (merged into "config")
  std::vector<std::string>
      notes;  ///< verification, method and policy lines, printed as "note: ..." before the table
  bool all_verified = true;
};

/// The seed experiment over cfg.sizes: rows min, native, native-discard, linear, stream, auto,
/// fused. Every row is checked against native before timing, to the matmul rounding bound
/// (a lane runs OpenBLAS with one thread, native with all).
/// @throws c10::Error from a kernel (e.g. a dtype the device has no matmul for).
WorkloadResult run_seed(const Config& cfg, Progress& progress);

/// One Adam step over cfg.model's trainable parameters: rows native, foreach, linear, stream,
/// auto, fused, each checked against native first (bitwise on the updated parameters).
/// @throws std::runtime_error when the model file cannot be read or parsed.
WorkloadResult run_optimizer(const Config& cfg, Progress& progress);

/// N leaves x E elements over cfg's grids, ops `add` and (x*2+y).sigmoid_(): rows native
/// (std::map loop), linear, stream, auto (per leaf), flat (consolidated), flat+read (flat, then
/// every result leaf made once), fused (the op's lambda through fuse() on the consolidated
/// trees, under automatic) and one-call (one ATen call over N*E elements, the floor).
/// Rows are checked against native first (add bitwise; the chain to sigmoid's accuracy).
WorkloadResult run_elementwise(const Config& cfg, Progress& progress);

/// The gradient trees of cfg.models all-reduced across the ranks of torchrun's environment
/// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; main() starts them with the built-in launcher):
/// rows native, tree, limit, tree+compute, async, compute, each checked on every rank first
/// (bitwise against the hand-computed sum). Every rank runs it; rank 0's timings are reported.
/// @throws std::runtime_error when a model file cannot be read; distributed errors.
WorkloadResult run_allreduce(const Config& cfg, Progress& progress);

/// The seed's loop with asyncs scopes (DESIGN.md §10): per step a decoder producing the next
/// batch, the training step (the seed's matmul, an in-place weight update) and metrics
/// written to a file. Rows sequential (the baseline), scoped (decoder and metrics in pending
/// scopes), submit (the same by hand with Thread::submit), each part alone and their sum and
/// max; every row's final weights and metrics file checked bitwise against sequential first.
/// Also measures the caller's cost of a pending call (notes, JSON config).
WorkloadResult run_overlap(const Config& cfg, Progress& progress);

/// Throws std::invalid_argument when cfg.device cannot be used by this LibTorch build.
void check_device(const Config& cfg);

/// Results by key (dotted tree path), as a strategy produced them.
using TensorMap = std::map<std::string, at::Tensor>;

/// How one result compares with native's: bitwise (elementwise work, optimizer steps) or
/// within the op's rounding bound (BLAS calls whose thread count differs), see
/// treetensor/tensor/rounding.hpp.
using Comparator = std::function<rounding::Agreement(const std::string& key, const at::Tensor& got,
                                                     const at::Tensor& want)>;

/// Every strategy's results checked against native's before timing, key by key, with one
/// Comparator. The note reports "bitwise equal" where it holds and else the worst ratio to the
/// rounding bound ("0.031 of the rounding bound").
class Verification {
 public:
  /// @param subject  what is verified, e.g. "S=64" or "resnet50" (starts the note).
  /// @param perturb  a strategy whose results are changed before checking (--perturb-row):
  ///                 one element of its first result moves by 1e-3 relative, so the report
  ///                 path of an unverified row can be exercised end to end.
  /// @param baseline the row the others are compared with, named in the note.
  Verification(std::string subject, Comparator compare, std::string perturb = "",
               std::string baseline = "native");
  /// Records whether `got` (which must hold exactly `expected_keys` keys, each also in
  /// `want`) agrees with `want` key by key.
  void check(const std::string& strategy, const TensorMap& want, TensorMap got,
             std::size_t expected_keys);
  /// Verdict of the i-th check(), in call order.
  bool passed(std::size_t i) const { return failures_[i].empty(); }
  bool all_passed() const;
  /// The strategies that failed, in check() order.
  std::vector<std::string> failed() const;
  /// One line for the output: all agree (which bitwise, the others' worst ratio to the bound),
  /// or what failed for whom.
  std::string note() const;

 private:
  std::string subject_, perturb_, baseline_;
  Comparator compare_;
  std::vector<std::string> names_, failures_;
  std::vector<double> worst_;  ///< worst ratio to the bound over a strategy's results
  std::vector<bool> bitwise_;
};

/// One trainable tensor of a model shapes file (data/models/<model>.json).
struct ParamShape {
  std::string key;
  std::vector<std::int64_t> shape;
};

struct ModelShapes {
  std::string name;
  std::vector<ParamShape> trainable;
  std::vector<at::Tensor> values;  ///< a checkpoint's stored parameters (empty for shape files)
  std::size_t skipped = 0;
  std::int64_t elements = 0;
};

/// Whether `key` names a buffer an optimizer never updates (running_mean, running_var,
/// num_batches_tracked).
bool is_buffer(const std::string& key);

/// The trainable tensors of a model shapes file {model, source, tensors: [{key, shape, dtype}]}.
/// @throws std::runtime_error when the file cannot be read or parsed.
ModelShapes load_model(const std::string& path);

/// The repetition plan for cfg: its -T, or the automatic plan.
RepPlan rep_plan(const Config& cfg);

}  // namespace treetensor::bench
