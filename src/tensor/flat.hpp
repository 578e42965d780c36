#pragma once
// Flat execution (DESIGN.md §12): an elementwise tree call on consolidated trees of one layout
// runs once per buffer group. Internal to the tensor layer (dispatch.cpp, reduce.cpp).

#include <optional>

#include "treetensor/tensor/consolidate.hpp"
#include "treetensor/tensor/dispatch.hpp"

namespace treetensor::detail {

/// map_leaves() flat, or nullopt when the call must run per leaf (see map_leaves()).
std::optional<TreeTensor> flat_map(const CallOptions& o, c10::ArrayRef<Operand> args, LeafFn f);

/// update_leaves() flat; false (nothing written) when the call must run per leaf.
/// @throws when a group after the first fails (the earlier groups are updated; the message
///         says which leaves were and were not).
bool flat_update(const CallOptions& o, c10::ArrayRef<Operand> args, LeafUpdate f);

/// The registry's integer column for op `name` without its trailing '_' (codegen/ops.toml;
/// false for an op not in the registry): defined in ops_generated.inc.
bool registry_integer(std::string_view name);

/// Marks every leaf of `t` written in place, for autograd's saved-tensor check. A made leaf of a
/// tree consolidated in place (consolidate() of leaves that already lay in a buffer,
/// treetensor.nn's parameters) keeps its own version counter, which a write to the buffer does
/// not move; a consolidated tree whose leaves have not been made bumps its buffers instead (the
/// views it makes later share their counters; making them here would cost a view per leaf).
void mark_written(const TensorTree& t);

/// The consolidated property of `t` when a tree-level reduction may run over its buffers (no
/// leaf needs a gradient while grad mode is on), else nullptr.
const ConsolidatedTree* flat_reducible(const TensorTree& t);

/// Group g's leaf elements as one 1-D tensor: the buffer itself when the layout is dense, else
/// the buffer without its padding (one masked_select).
at::Tensor leaf_elements(const ConsolidatedTree& c, std::size_t g);

}  // namespace treetensor::detail
