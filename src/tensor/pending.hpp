#pragma once
// Pending tree calls (DESIGN.md §10, "pending scopes"; OneFlow parity): inside a pending
// asyncs::ThreadScope a tree call is queued on the scope's thread and returns at once a
// pending tree (tree::Tree::is_pending) that waits for exactly that job when first looked at.
//
// The dispatch core borrows everything a call is made of (function_refs, string_views, the
// operand trees) for the duration of the call. A job that runs after the caller has returned
// needs its own copies: the *_owned forms below take the leaf function by value and copy the
// options and operands, so only ops whose leaf functions capture by value (no reference, no
// borrowed IntArrayRef) may use them. Every other op keeps the borrowing form, which inside a
// pending scope runs as a blocking call on the scope's thread (asyncs route_call).
// Internal (src/ only).

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "treetensor/asyncs/thread.hpp"
#include "treetensor/tensor/dispatch.hpp"

namespace treetensor::detail {

class PendingSource;
/// Pending operands of a call: their sources and whether the call writes them.
using PendingOperands = std::vector<std::pair<const PendingSource*, bool>>;

/// Appends the leaves of `t` (a consolidated tree's buffers instead: they share the leaves'
/// storage, the key of operand tracking) without waiting: pending subtrees are skipped and,
/// when `pending` is given, listed there with `write`.
void add_leaves(const TensorTree& t, std::vector<at::Tensor>& out, PendingOperands* pending,
                bool write = false);

/// A tree call's options and operands, owned by the job that runs it later. Operand trees are
/// copied (structure and tensor handles, never data; a pending operand stays pending and is
/// waited for by the job, when it reads it). The leaves it will read and write, for operand
/// tracking, are those of the operands that are not pending; a pending operand's job is
/// ordered before this one by the wait on it, and its leaves are registered for this job once
/// they exist (pending_operands()). The options' cost and check functions are
/// borrowed, so they are not kept: a body that needs them sets its own.
class OwnedCall {
 public:
  /// The first `written` arguments are written (in-place calls), the rest read.
  OwnedCall(const CallOptions& o, c10::ArrayRef<Operand> args, std::size_t written);
  OwnedCall(const OwnedCall&) = delete;
  OwnedCall& operator=(const OwnedCall&) = delete;

  const CallOptions& options() const noexcept { return options_; }
  c10::ArrayRef<Operand> args() const noexcept { return ops_; }
  /// The copy of tree argument k (args()[k] must be a tree).
  const TreeTensor& tree(std::size_t k) const { return trees_.at(slot_.at(k)); }
  const std::vector<at::Tensor>& reads() const noexcept { return reads_; }
  const std::vector<at::Tensor>& writes() const noexcept { return writes_; }
  /// The pending operands (and pending subtrees of operands) that reads() and writes() could
  /// not list: their leaves are registered for the job once they exist (PendingSource).
  const PendingOperands& pending_operands() const noexcept { return pending_; }

 private:
  std::string op_;
  std::vector<std::string> names_;
  std::vector<std::string_view> name_views_;
  at::Tensor missing_;
  CallOptions options_;
  std::vector<TreeTensor> trees_;
  std::vector<at::Tensor> tensors_;
  std::vector<std::size_t> slot_;  // per argument: its index in trees_ or tensors_
  std::vector<Operand> ops_;
  std::vector<at::Tensor> reads_, writes_;
  PendingOperands pending_;
};

using OwnedMap = std::function<TreeTensor(const CallOptions&, c10::ArrayRef<Operand>)>;
using OwnedUpdate = std::function<void(const CallOptions&, c10::ArrayRef<Operand>)>;

/// Queues `body(options, operands)` (owned copies of o and args) on `target` and returns the
/// pending tree of its result.
TreeTensor pending_map(const asyncs::PendingTarget& target, const CallOptions& o,
                       c10::ArrayRef<Operand> args, OwnedMap body);
/// Queues the in-place `body` on `target` and leaves each written tree argument
/// (args[0 .. o.written-1], the caller's own objects) pending on that job.
void pending_update(const asyncs::PendingTarget& target, const CallOptions& o,
                    c10::ArrayRef<Operand> args, OwnedUpdate body);

/// map_leaves(o, args, f, fused), pending inside a pending scope. `f` and `fused` are taken by
/// value and must own what they capture; `cost`, when given, is the leaf cost (o.cost is
/// borrowed, so a pending call keeps this function pointer instead).
template <class F, class G = std::nullptr_t>
TreeTensor map_owned(const CallOptions& o, c10::ArrayRef<Operand> args, F f, G fused = nullptr,
                     runtime::LeafCost (*cost)(const LeafArgs&) = nullptr) {
  if (const auto target = asyncs::pending_target())
    return pending_map(target, o, args,
                       [f = std::move(f), fused = std::move(fused), cost](
                           const CallOptions& po, c10::ArrayRef<Operand> pa) {
                         CallOptions with = po;
                         if (cost) with.cost = cost;
                         return map_leaves(with, pa, f, fused);
                       });
  return map_leaves(o, args, f, fused);
}

/// update_leaves(o, args, f, fused), pending inside a pending scope (same rule for f, fused).
template <class F, class G = std::nullptr_t>
void update_owned(const CallOptions& o, c10::ArrayRef<Operand> args, F f, G fused = nullptr) {
  if (const auto target = asyncs::pending_target())
    return pending_update(
        target, o, args,
        [f = std::move(f), fused = std::move(fused)](
            const CallOptions& po, c10::ArrayRef<Operand> pa) { update_leaves(po, pa, f, fused); });
  update_leaves(o, args, f, fused);
}

/// map1 (leafwise.hpp) with an owning leaf function: f(leaf) on every leaf of t.
template <class F>
TreeTensor map1_owned(const CallOptions& o, const TensorTree& t, F f) {
  const Operand args[] = {Operand(t)};
  return map_owned(o, args, [f = std::move(f)](const LeafArgs& x) { return f(x.t(0)); });
}
template <class F>
TreeTensor map1_owned(std::string_view op, const TensorTree& t, F f) {
  return map1_owned(CallOptions{op}, t, std::move(f));
}

/// update1 (leafwise.hpp) with an owning leaf function: f(leaf) in place on every leaf of t.
template <class F>
TreeTensor& update1_owned(const CallOptions& o, TreeTensor& t, F f) {
  const Operand args[] = {Operand(t)};
  update_owned(o, args, [f = std::move(f)](const LeafArgs& x) { f(x.t(0)); });
  return t;
}

}  // namespace treetensor::detail
