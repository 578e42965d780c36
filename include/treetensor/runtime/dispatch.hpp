#pragma once
// The single dispatch point between the tensor layer and the runtime (DESIGN.md, layers).
//
// Every tree-tensor op — operators, reductions, in-place ops — describes its leaf work as a
// LeafCall and hands it to runtime::run(). The runtime decides how to execute it (inline,
// linear, M lanes, fused, on an asyncs thread) and never knows about trees: leaves are
// indices 0..leaves-1, and `label(i)` names leaf i (its tree path) for error messages.

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

/// Executes a tree call's leaf work under the current execution strategy.
///
/// Every leaf job runs exactly once (or the fused form runs once). When leaf jobs throw, every
/// other leaf still runs; then the exception of the first failing leaf (in leaf order) is
/// rethrown with its original type where possible, its message prefixed with the op name and
/// the leaf's label, and the count and labels of the other failing leaves appended.
///
/// Thread safety: may be called from any thread, including from inside a leaf job (nesting
/// never deadlocks).
void run(const LeafCall& call);

}  // namespace treetensor::runtime
