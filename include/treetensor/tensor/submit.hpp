#pragma once
// asyncs::Thread::submit with trees of operands. The asyncs layer sits below the tensor layer
// and knows tensors only (DESIGN.md, layers), so the tree form lives here: it flattens the
// trees into the operand lists Thread::submit registers (operand tracking, DESIGN.md §10).

#include <string>
#include <utility>
#include <vector>

#include "treetensor/asyncs/thread.hpp"
#include "treetensor/tensor/tree_tensor.hpp"
#include "treetensor/tree/flatten.hpp"

namespace treetensor {

/// Queues `fn()` on `thread` as Thread::submit does, with every leaf of `reads` registered as
/// read and every leaf of `writes` as written: later tree calls on the submitting side that
/// write a leaf of `reads`, or touch a leaf of `writes`, wait for the job. The leaves are kept
/// alive until the job has finished; the trees themselves are not kept (a structure change
/// afterwards does not change what was registered).
/// Example:
///   auto f = treetensor::submit(metrics, [t] { return t.sum().item<double>(); }, t);
/// @throws as Thread::submit.
template <class F>
auto submit(asyncs::Thread& thread, F&& fn, const TensorTree& reads,
            const TensorTree& writes = TensorTree(), std::string label = {}) {
  const std::vector<at::Tensor> r = tree::flatten(reads).leaves;
  const std::vector<at::Tensor> w = tree::flatten(writes).leaves;
  return thread.submit(std::forward<F>(fn), r, w, std::move(label));
}

}  // namespace treetensor
