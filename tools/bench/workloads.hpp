#pragma once
// The two workloads of treetensor-bench.

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <map>

#include <string>
#include <vector>

#include "config.hpp"
#include "report.hpp"
#include "timing.hpp"

namespace treetensor::bench {

/// What a workload measured: one record per strategy and size, the JSON config entries that
/// describe it, and the verification lines for the output.
struct WorkloadResult {
  std::vector<Record> records;
  nlohmann::json config;           ///< workload-specific settings (merged into "config")
  std::vector<std::string> notes;  ///< verification and policy lines, printed before the table
  bool all_verified = true;
};

/// The seed experiment over cfg.sizes: rows min, native, native-discard, linear, stream, auto,
/// fused. Every row is checked against native before timing.
/// @throws c10::Error from a kernel (e.g. a dtype the device has no matmul for).
WorkloadResult run_seed(const Config& cfg, Progress& progress);

/// One Adam step over cfg.model's trainable parameters: rows native, foreach, linear, stream,
/// auto, fused, each checked against native (allclose on the updated parameters) first.
/// @throws std::runtime_error when the model file cannot be read or parsed.
WorkloadResult run_optimizer(const Config& cfg, Progress& progress);

/// Throws std::invalid_argument when cfg.device cannot be used by this LibTorch build.
void check_device(const Config& cfg);

/// Results by key (dotted tree path), as a strategy produced them.
using TensorMap = std::map<std::string, at::Tensor>;

/// Every strategy's results checked against native's before timing: allclose decides (kernels
/// such as bmm may round differently); bitwise equality is reported beside it.
class Verification {
 public:
  /// @param subject  what is verified, e.g. "S=64" or "resnet50" (starts the note).
  Verification(std::string subject, c10::ScalarType dtype);
  /// Records whether `got` (which must hold exactly `expected_keys` keys, each also in
  /// `want`) is allclose to `want` key by key, and whether it is bitwise equal.
  void check(const std::string& strategy, const TensorMap& want, const TensorMap& got,
             std::size_t expected_keys);
  /// Verdict of the i-th check(), in call order.
  bool passed(std::size_t i) const { return failures_[i].empty(); }
  bool all_passed() const;
  /// One line for the output: all equal (and which bitwise), or what failed for whom.
  std::string note() const;

 private:
  std::string subject_;
  c10::ScalarType dtype_;
  std::vector<std::string> names_, failures_;
  std::vector<bool> bitwise_;
};

/// The repetition plan for cfg: its -T, or the automatic plan.
RepPlan rep_plan(const Config& cfg);

/// allclose tolerances for cfg.dtype: {rtol, atol}.
std::pair<double, double> tolerances(c10::ScalarType dtype);

}  // namespace treetensor::bench
