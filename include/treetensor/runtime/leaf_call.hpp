#pragma once
// What crosses the dispatch point (dispatch.hpp): the description of one tree call, and the
// decision on how it runs. Plain types with no source file of their own, so that the policy
// (policy.cpp) can speak of calls and decisions without including the dispatch point that
// calls it (DESIGN.md, layers: no include loops inside the runtime).

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/FunctionRef.h>

#include <cstddef>
#include <string>
#include <string_view>

namespace treetensor::runtime {

/// Estimated cost of one leaf job, used by the execution policy.
struct LeafCost {
  double flops = 0;  ///< floating-point operations (matmul of m×k @ k×n: 2·m·k·n)
  double bytes = 0;  ///< bytes read plus bytes written
};

/// What the tensor layer tells the runtime about one tree call.
///
/// All callables are borrowed for the duration of run() only.
struct LeafCall {
  /// Op name, e.g. "matmul" or "add_"; appears in error messages and policy decisions.
  std::string_view op;
  /// Number of leaf jobs.
  std::size_t leaves = 0;
  /// Runs leaf i. Called exactly once per i; distinct i may run concurrently on other threads.
  c10::function_ref<void(std::size_t)> run;
  /// Names leaf i (its dotted tree path) for error messages. Only called on error.
  c10::function_ref<std::string(std::size_t)> label;
  /// Estimated cost of leaf i; when null, every leaf is taken to cost the same.
  c10::function_ref<LeafCost(std::size_t)> cost = nullptr;
  /// Optional batched form: runs every leaf's work in one call (e.g. bmm over stacked leaves)
  /// and returns true, or returns false without side effects when it cannot (shapes differ).
  /// When it returns true, run() is not called for any leaf.
  c10::function_ref<bool()> fused = nullptr;
  /// Device and dtype of the first leaf (policy input); CPU/float when there are no leaves.
  c10::Device device = c10::Device(c10::kCPU);
  c10::ScalarType dtype = c10::kFloat;
};

/// How one call is (or would be) executed.
enum class Strategy { linear, lanes, fused };

/// A policy decision: the strategy, the number of lanes used (1 for linear and fused) and why.
struct Decision {
  Strategy strategy = Strategy::linear;
  std::size_t lanes = 1;
  std::string reason;
};

/// "linear", "lanes" or "fused".
constexpr const char* to_string(Strategy s) {
  switch (s) {
    case Strategy::linear:
      return "linear";
    case Strategy::lanes:
      return "lanes";
    case Strategy::fused:
      return "fused";
  }
  return "?";
}

}  // namespace treetensor::runtime
