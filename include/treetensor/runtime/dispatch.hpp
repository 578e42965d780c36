#pragma once
// The single dispatch point between the tensor layer and the runtime (DESIGN.md, layers).
//
// Every tree-tensor op — operators, reductions, in-place ops — describes its leaf work as a
// LeafCall and hands it to runtime::run(). The runtime decides how to execute it (inline,
// linear, M lanes, fused) and never knows about trees: leaves are indices 0..leaves-1, and
// `label(i)` names leaf i (its tree path) for error messages. Nor does it know the layers
// above it: asyncs (and later distributed) take part in tree calls and in synchronize()
// through the hooks they register here (DESIGN.md, layers).

#include "treetensor/runtime/leaf_call.hpp"  // IWYU pragma: export

#include <c10/util/FunctionRef.h>

namespace treetensor::runtime {

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

/// What run() would do with `call` under the current mode, without running it or calling its
/// leaf functions (only `cost`, under automatic). Under automatic the answer reflects the
/// measurements made so far, so a later call may differ; the reason names them, e.g.
/// "measured: linear 1861.9 us, lanes(2) 1020.4 us, fused 4342.7 us".
/// The first automatic use runs the one-time calibration.
/// Thread safety: thread-safe.
Decision explain(const LeafCall& call);

// ---- the registration point for the layers above (DESIGN.md, layers) ----------------------

/// Passes a call on to the rest of the dispatch (the hooks registered after the caller's, then
/// the execution strategy).
using Proceed = c10::function_ref<void(const LeafCall&)>;

/// A layer's say in every tree call. run() calls the hooks in registration order, first thing
/// after its no-leaves check. A hook returns false to let the call go on unchanged, or true
/// when it has executed the call itself: elsewhere (asyncs: on a ThreadScope's thread, where
/// the call re-enters run()) or through `proceed` (asyncs: with each leaf wrapped). A hook must
/// cost next to nothing when it declines: it runs on every tree call.
using CallHook = bool (*)(const LeafCall& call, Proceed proceed);

/// Registers `hook` for every later run(). Hooks cannot be removed: a layer installs its own
/// once, when it is first used.
/// @throws std::length_error past 8 hooks.
/// Thread safety: thread-safe; a run() already past the hooks is not affected.
void add_call_hook(CallHook hook);

/// A layer's part of synchronize(): waits for the work it has in flight and reports its
/// errors by throwing.
using SynchronizeHook = void (*)();

/// Registers `hook` for every later synchronize(). @throws std::length_error past 8 hooks.
/// Thread safety: thread-safe.
void add_synchronize_hook(SynchronizeHook hook);

/// Waits for all work in flight: every registered layer's (asyncs: every job submitted before
/// this call, then its error no Future::get()/wait() observed; see asyncs/thread.hpp), then, on
/// devices with streams, the lanes' streams (DESIGN.md §7, §10). Tree calls themselves need no
/// synchronize: a call returns when its leaves are done and its lane streams are joined back
/// to the caller's stream.
/// @throws the first exception a hook threw, after every hook ran and the lane streams were
///         synchronized (asyncs: the first unobserved job error, with the others listed in its
///         message; WatchdogTimeout; AsyncsUsageError when called from inside an asyncs job).
/// Thread safety: safe from any thread that is not running an asyncs job.
void synchronize();

}  // namespace treetensor::runtime
