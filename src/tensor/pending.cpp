// Pending tree calls: owned copies of a call, the job that runs it, the pending trees that
// stand for its results (pending.hpp; DESIGN.md §10, "pending scopes").
#include "tensor/pending.hpp"

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>

#include "treetensor/tensor/consolidate.hpp"

namespace treetensor::detail {

// A pending tree's source: waits for its job. Jobs that took the pending tree as an operand
// before its content existed (readers) could not register its leaves then; they are
// registered once the content exists, so that a later write of those leaves waits for a
// reader and a later read for a writer, as for any operand (operands.hpp).
class PendingSource : public TensorTree::Source {
 public:
  using AddOperands = std::function<void(c10::ArrayRef<at::Tensor>, c10::ArrayRef<at::Tensor>)>;

  bool pending() const noexcept final { return true; }
  TensorTree make() const final {
    TensorTree t = wait();
    std::lock_guard lock(mu_);
    if (!readers_.empty()) {
      const auto leaves = content_leaves(t);
      for (const Reader& r : readers_) add(r, leaves);
      readers_.clear();
    }
    return t;
  }
  /// Registers the job behind `add` as reading (or writing) this tree's leaves: at once when
  /// they are known, else when the tree is first made.
  void add_reader(AddOperands add_operands, bool write) const {
    std::lock_guard lock(mu_);
    const Reader r{std::move(add_operands), write};
    if (auto leaves = known_leaves()) return add(r, *leaves);
    readers_.push_back(r);
  }

 protected:
  /// The content, once the job has run (blocks; rethrows the job's error).
  virtual TensorTree wait() const = 0;
  /// The leaves, when known without waiting; nullopt otherwise (also after a failure: a
  /// reader of a failed result fails itself and needs no ordering).
  virtual std::optional<std::vector<at::Tensor>> known_leaves() const = 0;

  static std::vector<at::Tensor> content_leaves(const TensorTree& t) {
    std::vector<at::Tensor> out;
    add_leaves(t, out, nullptr);
    return out;
  }

 private:
  struct Reader {
    AddOperands add_operands;
    bool write;
  };
  static void add(const Reader& r, const std::vector<at::Tensor>& leaves) {
    r.write ? r.add_operands({}, leaves) : r.add_operands(leaves, {});
  }
  mutable std::mutex mu_;
  mutable std::vector<Reader> readers_;
};

namespace {

// A tree call's result: its job's value, or its error rethrown at every read.
class PendingResult final : public PendingSource {
 public:
  explicit PendingResult(asyncs::Future<TreeTensor> f) : future_(std::move(f)) {}

 private:
  TensorTree wait() const override { return future_.get(); }
  bool wait_for(std::chrono::milliseconds timeout) const override {
    return future_.wait_for(timeout);
  }
  std::optional<std::vector<at::Tensor>> known_leaves() const override {
    if (!future_.ready() || future_.failed()) return std::nullopt;  // see known_leaves()
    return content_leaves(future_.get());
  }
  asyncs::Future<TreeTensor> future_;
};

// A tree written in place by a pending call: the job's copy of it (the same leaf tensors) once
// the job has run. `leaves`: the target's leaves when all were known at submission (no pending
// node in it). A failed job's error is raised by the first read only: afterwards the tree is
// what the failed call left, as a failed in-place call without a scope leaves it (its message
// says which leaves were updated).
class PendingWrite final : public PendingSource {
 public:
  PendingWrite(asyncs::Future<void> f, std::shared_ptr<const OwnedCall> call, std::size_t arg,
               std::optional<std::vector<at::Tensor>> leaves)
      : future_(std::move(f)), call_(std::move(call)), arg_(arg), leaves_(std::move(leaves)) {}

 private:
  TensorTree wait() const override {
    try {
      future_.get();
    } catch (...) {
      if (!raised_.exchange(true)) throw;
    }
    return call_->tree(arg_);
  }
  bool wait_for(std::chrono::milliseconds timeout) const override {
    return future_.wait_for(timeout);
  }
  std::optional<std::vector<at::Tensor>> known_leaves() const override {
    if (leaves_) return leaves_;
    if (!future_.ready()) return std::nullopt;
    return content_leaves(call_->tree(arg_));  // the job has made every node of its copy
  }
  asyncs::Future<void> future_;
  std::shared_ptr<const OwnedCall> call_;
  std::size_t arg_;
  std::optional<std::vector<at::Tensor>> leaves_;
  mutable std::atomic<bool> raised_{false};
};

std::string label_of(const CallOptions& o) {
  return "tree call " + std::string(o.op);
}

// Registers the job of `future` with the pending operands of `call` (PendingSource).
template <class T>
void add_to_pending_operands(const OwnedCall& call, const asyncs::Future<T>& future) {
  for (const auto& [source, write] : call.pending_operands())
    source->add_reader([future](c10::ArrayRef<at::Tensor> r,
                                c10::ArrayRef<at::Tensor> w) { future.add_operands(r, w); },
                       write);
}

}  // namespace

void add_leaves(const TensorTree& t, std::vector<at::Tensor>& out, PendingOperands* pending,
                bool write) {
  // A pending node is skipped and listed. Another thread may make it meanwhile: it is still
  // listed, and add_reader then registers its leaves at once. A pending source that is not
  // ours cannot list readers: that node is made (waited for) and walked.
  const auto skip = [&](const TensorTree& n) {
    if (!n.is_pending()) return false;
    const auto* source = dynamic_cast<const PendingSource*>(n.pending_source());
    if (source == nullptr) {
      (void)n.is_leaf();
      return false;
    }
    if (pending != nullptr) pending->emplace_back(source, write);
    return true;
  };
  if (skip(t)) return;
  if (const ConsolidatedTree* c = consolidated_source(t)) {
    out.insert(out.end(), c->buffers().begin(), c->buffers().end());
    return;
  }
  std::vector<const TensorTree*> stack{&t};
  while (!stack.empty()) {
    const TensorTree* n = stack.back();
    stack.pop_back();
    if (n->is_leaf()) {
      out.push_back(n->leaf());
      continue;
    }
    for (const auto& [key, child] : n->children())
      if (!skip(child)) stack.push_back(&child);
  }
}

OwnedCall::OwnedCall(const CallOptions& o, c10::ArrayRef<Operand> args, std::size_t written)
    : op_(o.op), missing_(o.missing ? *o.missing : at::Tensor()), options_(o) {
  options_.op = op_;
  options_.missing = o.missing ? &missing_ : nullptr;
  names_.assign(o.arg_names.begin(), o.arg_names.end());
  name_views_.assign(names_.begin(), names_.end());
  options_.arg_names = name_views_;
  options_.cost = nullptr;  // borrowed from the caller: the job's body sets its own, if any
  options_.check = nullptr;
  trees_.reserve(args.size());
  tensors_.reserve(args.size());
  for (std::size_t k = 0; k < args.size(); ++k) {
    const Operand& a = args[k];
    if (a.is_tree()) {
      slot_.push_back(trees_.size());
      trees_.emplace_back(a.tree());
      add_leaves(a.tree(), k < written ? writes_ : reads_, &pending_, k < written);
    } else if (a.kind() == Operand::Kind::tensor) {
      slot_.push_back(tensors_.size());
      tensors_.push_back(a.tensor());
      reads_.push_back(a.tensor());
    } else {
      slot_.push_back(0);
    }
  }
  for (std::size_t k = 0; k < args.size(); ++k) {
    const Operand& a = args[k];
    if (a.is_tree()) {
      ops_.emplace_back(static_cast<const TensorTree&>(trees_[slot_[k]]));
    } else if (a.kind() == Operand::Kind::tensor) {
      ops_.emplace_back(tensors_[slot_[k]]);
    } else {
      ops_.push_back(a);
    }
  }
}

TreeTensor pending_map(const asyncs::PendingTarget& target, const CallOptions& o,
                       c10::ArrayRef<Operand> args, OwnedMap body) {
  auto call = std::make_shared<const OwnedCall>(o, args, 0);
  auto future =
      target.submit([call, body = std::move(body)] { return body(call->options(), call->args()); },
                    call->reads(), call->writes(), label_of(o));
  add_to_pending_operands(*call, future);
  return TreeTensor(TensorTree::deferred(std::make_shared<PendingResult>(std::move(future))));
}

void pending_update(const asyncs::PendingTarget& target, const CallOptions& o,
                    c10::ArrayRef<Operand> args, OwnedUpdate body) {
  auto call = std::make_shared<const OwnedCall>(o, args, o.written);
  auto future =
      target.submit([call, body = std::move(body)] { body(call->options(), call->args()); },
                    call->reads(), call->writes(), label_of(o));
  add_to_pending_operands(*call, future);
  // The caller's trees are its own objects behind const Operands (the in-place ops take them
  // by non-const reference): from now on each stands for the job's copy, once it has run.
  for (std::size_t k = 0; k < o.written && k < args.size(); ++k) {
    if (!args[k].is_tree()) continue;
    std::optional<std::vector<at::Tensor>> leaves;
    PendingOperands inner;
    std::vector<at::Tensor> found;
    add_leaves(call->tree(k), found, &inner);
    if (inner.empty()) leaves = std::move(found);  // else: known once the job has run
    const_cast<TensorTree&>(args[k].tree()) =
        TensorTree::deferred(std::make_shared<PendingWrite>(future, call, k, std::move(leaves)));
  }
}

}  // namespace treetensor::detail
