// Flat execution: one call per buffer group of consolidated trees (flat.hpp, DESIGN.md §12).
#include "tensor/flat.hpp"
#include "tensor/leafwise.hpp"

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <string>

#include "treetensor/asyncs/operands.hpp"
#include "treetensor/runtime/cpu_allocator.hpp"
#include "treetensor/runtime/errors.hpp"
#include "treetensor/runtime/stream.hpp"

namespace treetensor::detail {
namespace {

// Whether some made leaf of `t` needs a gradient. A deferred tree's leaves were never handed
// out, so none can have been asked for one (results of flat calls never require grad); a
// pending one is waited for first.
bool any_leaf_requires_grad(const TensorTree& t) {
  if (t.is_pending()) (void)t.is_leaf();  // an asyncs pending result: its leaves once made
  if (t.is_deferred()) return false;
  return !all_leaves(t, [](const at::Tensor& x) { return !x.requires_grad(); });
}

// Whether buffers of dtype `t` run the call flat: floating, complex and bool always; integers
// for the ops that raise for no value (CallOptions::integer_safe, the registry's integer
// column): the others (division and remainder by zero, pow to a negative power) could fail
// half-way through a buffer, possibly on its padding, where the per-leaf loop would not.
bool flat_dtype(at::ScalarType t, const CallOptions& o) {
  if (at::isFloatingType(t) || at::isComplexType(t) || t == at::kBool) return true;
  if (!at::isIntegralType(t, /*includeBool=*/false)) return false;
  if (o.integer_safe) return true;
  std::string_view op = o.op;
  if (!op.empty() && op.back() == '_') op.remove_suffix(1);
  return registry_integer(op);
}

// glibc serves blocks above this size (its largest mmap threshold) with a fresh mmap, and
// unmaps them on free: every new result buffer that large is paid for again with one page
// fault per 4 KiB, while a per-leaf loop over smaller leaves recycles its freed blocks.
// Measured here (2000 x 65536 floats, add): one call into a fresh 512 MiB buffer 4x slower
// than the per-leaf loop.
constexpr int64_t kFreshBufferLimit = int64_t{32} << 20;

// Whether allocating this call's result buffers (about the size of the operand buffers) would
// pay those page faults: large CPU buffers, LibTorch's default allocator, and not stream(fused)
// (which asks for one call whatever it costs).
bool fresh_buffers_fault(const ConsolidatedTree& c) {
  if (runtime::current_stream_mode().kind == runtime::StreamMode::Kind::fused ||
      runtime::caching_cpu_allocator_installed())
    return false;
  for (const at::Tensor& b : c.buffers())
    if (b.device().is_cpu() && b.numel() * int64_t(b.element_size()) > kFreshBufferLimit)
      return true;
  return false;
}

// The consolidated source of every tree argument (nullptr for the others) when the call can run
// flat, else empty. `allocates`: the call makes new result buffers (not in place).
std::vector<const ConsolidatedTree*> plan(const CallOptions& o, c10::ArrayRef<Operand> args,
                                          bool allocates) {
  // Every mode: consolidation is the caller's explicit choice, and one call per buffer is what
  // linear, lanes (ATen splits a large buffer over its intra-op threads), fused and automatic
  // would each pick for it, except where a fresh result buffer costs more (below).
  if (!o.elementwise) return {};
  const bool grad = at::GradMode::is_enabled();
  std::vector<const ConsolidatedTree*> src(args.size(), nullptr);
  const ConsolidatedTree* first = nullptr;
  bool tensors = false;
  for (std::size_t k = 0; k < args.size(); ++k) {
    if (args[k].kind() == Operand::Kind::tensor) {
      const at::Tensor& t = args[k].tensor();
      if (!t.defined() || t.dim() != 0 || (grad && t.requires_grad())) return {};
      tensors = true;
    }
    if (!args[k].is_tree()) continue;
    const ConsolidatedTree* c = consolidated_source(args[k].tree());
    if (!c) return {};
    if (!first) {
      first = c;
    } else if (c->layout_ptr() != first->layout_ptr() && !(c->layout() == first->layout())) {
      return {};
    }
    for (std::size_t g = 0; g < c->buffers().size(); ++g)
      if (!flat_dtype(c->buffers()[g].scalar_type(), o) ||
          c->buffers()[g].device() != first->buffers()[g].device())
        return {};
    if (grad && any_leaf_requires_grad(args[k].tree())) return {};
    src[k] = c;
  }
  if (!first || first->layout().leaves() == 0) return {};
  if (tensors && first->layout().has_scalar_leaf()) return {};  // 0-d promotion differs
  if (allocates && fresh_buffers_fault(*first)) return {};
  return src;
}

// In place, a buffer is updated in pieces of this many bytes (about), so that the runtime can
// spread a large buffer over lanes by element range (at::parallel_for's threads are one per
// lane's budget, and one here: ATen's intra-op pool is a single thread on this machine).
constexpr int64_t kPieceBytes = int64_t{1} << 20;

// One leaf job of a flat call: elements [begin, end) of group g's buffers.
struct Piece {
  std::size_t group;
  int64_t begin, end;
};

// The operand rows of every piece, as map_leaves' Zip gives them per leaf (one row per piece,
// so pieces may run on lanes concurrently).
class Rows {
 public:
  Rows(const CallOptions& o, c10::ArrayRef<Operand> args,
       const std::vector<const ConsolidatedTree*>& src, bool split)
      : args_(args), src_(src), wrapped_(args.size()) {
    const ConsolidatedTree* first = nullptr;
    for (const ConsolidatedTree* c : src)
      if (c && !first) first = c;
    for (std::size_t g = 0; g < first->buffers().size(); ++g) {
      const at::Tensor& b = first->buffers()[g];
      const int64_t n = b.numel();
      int64_t step = n;
      if (split && !overlaps(g)) {
        step = std::max<int64_t>(kPieceBytes / int64_t(b.element_size()), 64) / 64 * 64;
        step = std::max<int64_t>(step, 64);
      }
      for (int64_t lo = 0; lo < n || lo == 0; lo += std::max<int64_t>(step, 1)) {
        pieces_.push_back({g, lo, std::min(n, lo + step)});
        if (step >= n) break;
      }
    }
    std::vector<const at::Tensor*> base(args.size(), &undefined_);
    for (std::size_t k = 0; k < args.size(); ++k) {
      if (args[k].kind() == Operand::Kind::tensor) base[k] = &args[k].tensor();
      if (args[k].kind() == Operand::Kind::scalar && o.wrap_scalars) {
        wrapped_[k] = at::native::wrapped_scalar_tensor(args[k].scalar());
        base[k] = &wrapped_[k];
      }
    }
    slices_.reserve(pieces_.size() * args.size());  // rows_ points into it: no reallocation
    rows_.reserve(pieces_.size() * args.size());
    for (const Piece& p : pieces_)
      for (std::size_t k = 0; k < args.size(); ++k) {
        if (!src[k]) {
          rows_.push_back(base[k]);
          continue;
        }
        const at::Tensor& b = src[k]->buffers()[p.group];
        if (p.begin == 0 && p.end == b.numel()) {
          rows_.push_back(&b);  // the whole buffer: no view made
        } else {
          slices_.push_back(b.narrow(0, p.begin, p.end - p.begin));
          rows_.push_back(&slices_.back());
        }
      }
  }
  std::size_t pieces() const noexcept { return pieces_.size(); }
  const Piece& piece(std::size_t i) const { return pieces_[i]; }
  LeafArgs row(std::size_t i) const {
    return LeafArgs(rows_.data() + i * args_.size(), args_.data(), i);
  }
  // Operand tracking (asyncs, DESIGN.md §10) on the buffers, which share the leaves' storage.
  void await(std::size_t written) const {
    if (!asyncs::tracking_active()) return;
    std::vector<at::Tensor> reads, writes;
    for (std::size_t k = 0; k < args_.size(); ++k) {
      if (args_[k].kind() == Operand::Kind::tensor) reads.push_back(args_[k].tensor());
      if (!src_[k]) continue;
      auto& dst = k < written ? writes : reads;
      dst.insert(dst.end(), src_[k]->buffers().begin(), src_[k]->buffers().end());
    }
    asyncs::await_operands(reads, writes);
  }

 private:
  // Whether group g's target buffer shares memory with another operand's buffer other than
  // itself: pieces could then read what another piece writes, so the group stays whole.
  bool overlaps(std::size_t g) const {
    const at::Tensor& target = src_[0]->buffers()[g];
    for (std::size_t k = 1; k < args_.size(); ++k) {
      if (!src_[k]) continue;
      const at::Tensor& b = src_[k]->buffers()[g];
      if (b.storage().is_alias_of(target.storage()) &&
          (b.data_ptr() != target.data_ptr() || b.numel() != target.numel()))
        return true;
    }
    return false;
  }

  c10::ArrayRef<Operand> args_;
  const std::vector<const ConsolidatedTree*>& src_;
  at::Tensor undefined_;
  std::vector<at::Tensor> wrapped_;
  std::vector<Piece> pieces_;
  std::vector<at::Tensor> slices_;
  std::vector<const at::Tensor*> rows_;
};

std::string piece_label(const ConsolidatedTree& c, const Piece& p) {
  const at::Tensor& b = c.buffers()[p.group];
  return "buffer " + std::to_string(p.group) + " (" + std::string(c10::toString(b.scalar_type())) +
         ", " + b.device().str() + ") elements [" + std::to_string(p.begin) + ", " +
         std::to_string(p.end) + ")";
}

// One leaf call per piece through the runtime (so asyncs scopes and the policy see it).
void run_pieces(const CallOptions& o, const Rows& rows, const ConsolidatedTree& layout_src,
                c10::function_ref<void(std::size_t)> run_piece) {
  auto run = [&](std::size_t i) { run_piece(i); };
  auto label = [&](std::size_t i) { return piece_label(layout_src, rows.piece(i)); };
  auto cost = [&](std::size_t i) {
    const Piece& p = rows.piece(i);
    const double b = static_cast<double>(p.end - p.begin) *
                     static_cast<double>(layout_src.buffers()[p.group].element_size());
    return runtime::LeafCost{b / 4, 2 * b};
  };
  runtime::LeafCall call{o.op, rows.pieces(), run, label, cost};
  call.device = layout_src.buffers()[0].device();
  call.dtype = layout_src.buffers()[0].scalar_type();
  runtime::run(call);
}

// Whether `r` shares storage with an operand's buffer: the op handed back its input (`to` its
// own dtype and device) or a view of it. A new consolidated tree over that buffer would be a
// second owner of it whose in-place calls and version bumps do not reach the operand's leaves
// (which, made in place by consolidate(), keep their own version counters).
bool aliases_operand(const at::Tensor& r, const std::vector<const ConsolidatedTree*>& src) {
  if (!r.has_storage()) return false;
  for (const ConsolidatedTree* c : src)
    if (c)
      for (const at::Tensor& b : c->buffers())
        if (r.storage().is_alias_of(b.storage())) return true;
  return false;
}

// The operand itself when the op handed back each of its buffers unchanged (`to` its own dtype
// and device), as torch's `to` gives self: the same leaves, not a second tree over its buffers.
std::optional<TreeTensor> operand_returned(c10::ArrayRef<Operand> args,
                                           const std::vector<const ConsolidatedTree*>& src,
                                           const std::vector<at::Tensor>& out) {
  for (std::size_t k = 0; k < src.size(); ++k) {
    if (!src[k] || src[k]->buffers().size() != out.size()) continue;
    bool same = true;
    for (std::size_t g = 0; g < out.size() && same; ++g)
      same = out[g].is_same(src[k]->buffers()[g]);
    if (same) return TreeTensor(args[k].tree());
  }
  return std::nullopt;
}

// After a flat in-place call: the trees written (the first `written` arguments) marked so.
void bump_made_leaves(c10::ArrayRef<Operand> args, std::size_t written) {
  for (std::size_t k = 0; k < written && k < args.size(); ++k)
    if (args[k].is_tree()) mark_written(args[k].tree());
}

}  // namespace

void mark_written(const TensorTree& t) {
  const bool unmade = t.is_deferred() && !t.is_pending();  // source() would make a pending one
  if (const ConsolidatedTree* c = unmade ? consolidated_source(t) : nullptr) {
    for (const at::Tensor& b : c->buffers()) b.unsafeGetTensorImpl()->bump_version();
    return;
  }
  all_leaves(t, [](const at::Tensor& x) {
    x.unsafeGetTensorImpl()->bump_version();
    return true;
  });
}

std::optional<TreeTensor> flat_map(const CallOptions& o, c10::ArrayRef<Operand> args, LeafFn f) {
  const auto src = plan(o, args, /*allocates=*/true);
  if (src.empty()) return std::nullopt;
  const ConsolidatedTree* first = nullptr;
  for (const ConsolidatedTree* c : src)
    if (c && !first) first = c;
  Rows rows(o, args, src, /*split=*/false);  // one piece per group: one fresh result buffer each
  rows.await(0);
  std::vector<at::Tensor> out(rows.pieces());
  try {
    run_pieces(o, rows, *first, [&](std::size_t g) { out[g] = f(rows.row(g)); });
  } catch (...) {
    return std::nullopt;  // the per-leaf path runs it again and names the failing leaf
  }
  if (const auto same = operand_returned(args, src, out)) return same;  // torch's `to`: self
  for (std::size_t g = 0; g < out.size(); ++g)
    if (!out[g].defined() || out[g].dim() != 1 ||
        out[g].numel() != first->layout().group_numel(g) || !out[g].is_contiguous() ||
        aliases_operand(out[g], src))
      return std::nullopt;  // not elementwise on this input after all, or a view of an operand
  return consolidated_tree(first->layout_ptr(), std::move(out));
}

bool flat_update(const CallOptions& o, c10::ArrayRef<Operand> args, LeafUpdate f) {
  if (args.empty() || !args[0].is_tree()) return false;
  const auto src = plan(o, args, /*allocates=*/false);
  if (src.empty()) return false;
  Rows rows(o, args, src, /*split=*/true);
  if (o.check)  // a problem: the per-leaf path checks again and names the leaf
    for (std::size_t i = 0; i < rows.pieces(); ++i)
      if (!o.check(rows.row(i)).empty()) return false;
  rows.await(o.written);
  std::vector<std::uint8_t> done(rows.pieces(), 0);
  try {
    run_pieces(o, rows, *src[0], [&](std::size_t i) {
      f(rows.row(i));
      done[i] = 1;
    });
  } catch (...) {
    // Floating kernels check their operands before writing: when no piece finished, nothing
    // was written, and the per-leaf path runs it again and names the failing leaf.
    std::string updated;
    for (std::size_t i = 0; i < done.size(); ++i)
      if (done[i]) updated += (updated.empty() ? "" : "; ") + piece_label(*src[0], rows.piece(i));
    if (updated.empty()) return false;
    bump_made_leaves(args, o.written);  // some leaves were written
    runtime::rethrow_with_context(
        std::current_exception(),
        "in-place " + std::string(o.op) + " (flat): updated " + updated + "; the rest not");
  }
  bump_made_leaves(args, o.written);
  return true;
}

const ConsolidatedTree* flat_reducible(const TensorTree& t) {
  const ConsolidatedTree* c = consolidated_source(t);
  if (!c || c->layout().leaves() == 0) return nullptr;
  if (at::GradMode::is_enabled() && any_leaf_requires_grad(t)) return nullptr;
  return c;
}

at::Tensor leaf_elements(const ConsolidatedTree& c, std::size_t g) {
  const at::Tensor& b = c.buffers()[g];
  if (c.layout().dense()) return b;
  return b.masked_select(c.layout().mask(g, b.device()));
}

}  // namespace treetensor::detail
