#pragma once
// The two workloads of treetensor-bench.

#include <nlohmann/json.hpp>

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
  nlohmann::json config;            ///< workload-specific settings (merged into "config")
  std::vector<std::string> notes;   ///< verification and policy lines, printed before the table
  bool all_verified = true;
};

/// The seed experiment over cfg.sizes: rows min, native, native-discard, linear, stream, auto,
/// fused. Every row is checked against native before timing.
/// @throws std::invalid_argument on an unusable setting (e.g. CUDA without a CUDA build).
WorkloadResult run_seed(const Config& cfg, Progress& progress);

/// One Adam step over cfg.model's trainable parameters: rows native, foreach, linear, stream,
/// auto, fused, each checked against native (allclose on the updated parameters) first.
/// @throws std::runtime_error when the model file cannot be read or parsed.
WorkloadResult run_optimizer(const Config& cfg, Progress& progress);

/// Throws std::invalid_argument when cfg.device cannot be used by this LibTorch build.
void check_device(const Config& cfg);

/// The repetition plan for cfg: its -T, or the automatic plan.
RepPlan rep_plan(const Config& cfg);

/// allclose tolerances for cfg.dtype: {rtol, atol}.
std::pair<double, double> tolerances(c10::ScalarType dtype);

}  // namespace treetensor::bench
