#pragma once
// The umbrella header: the tree layer, the runtime (execution modes), the asyncs layer (worker
// threads, operand tracking) and the tensor layer (DESIGN.md, layers). Include this from
// applications; library code includes what it uses.
//
// Example:
//   #include <treetensor/treetensor.hpp>
//   namespace tt = treetensor;
//   tt::TreeTensor t = tt::randn({{"a", {2, 3}}, {"b", {{"x", {3, 4}}}}});
//   tt::runtime::StreamGuard lanes(2);      // leaf work of the calls below on two lanes
//   at::Tensor m = tt::mean(t.sigmoid());   // one value over every element of every leaf

#include "treetensor/asyncs/operands.hpp"   // IWYU pragma: export
#include "treetensor/asyncs/thread.hpp"     // IWYU pragma: export
#include "treetensor/io/adam_state.hpp"     // IWYU pragma: export
#include "treetensor/io/checkpoint.hpp"     // IWYU pragma: export
#include "treetensor/io/safetensors.hpp"    // IWYU pragma: export
#include "treetensor/runtime/dispatch.hpp"  // IWYU pragma: export
#include "treetensor/runtime/errors.hpp"    // IWYU pragma: export
#include "treetensor/runtime/stream.hpp"    // IWYU pragma: export
#include "treetensor/tensor/tensor.hpp"     // IWYU pragma: export
#include "treetensor/tree/tree.hpp"         // IWYU pragma: export
