#pragma once
// The asyncs hook at the top of runtime::run() (dispatch.cpp). Not installed.

#include "treetensor/runtime/dispatch.hpp"

namespace treetensor::runtime::detail {

/// Called by runtime::run() before anything else but its no-leaves check. Returns true when it
/// has executed `call` itself:
///  - inside a ThreadScope (of a thread other than the one running the code), the call is
///    queued on the scope's asyncs thread and the caller blocks until it has run;
///  - inside an asyncs job, the call is re-dispatched (once) with each leaf wrapped so that the
///    lane running it knows which job it belongs to (for await_operands, Future::get and
///    submits made by nested tree calls).
/// Returns false, at the cost of a few thread-local reads, when run() should proceed as usual.
/// @throws whatever the tree call throws, with asyncs context added when it ran on a thread.
bool run_on_scoped_thread(const LeafCall& call);

}  // namespace treetensor::runtime::detail
