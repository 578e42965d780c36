// Flat execution: one call per buffer group of consolidated trees (flat.hpp, DESIGN.md §12).
#include "tensor/flat.hpp"

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/grad_mode.h>

#include <cstdint>
#include <exception>
#include <string>

#include "treetensor/asyncs/operands.hpp"
#include "treetensor/runtime/cpu_allocator.hpp"
#include "treetensor/runtime/stream.hpp"
#include "treetensor/runtime/errors.hpp"

namespace treetensor::detail {
namespace {

// Whether some made leaf of `t` needs a gradient. A deferred tree's leaves were never handed
// out, so none can have been asked for one (results of flat calls never require grad).
bool any_leaf_requires_grad(const TensorTree& t) {
  if (t.is_deferred()) return false;
  tree::detail::WalkStack<const TensorTree*> stack;
  stack.push(&t);
  while (!stack.empty()) {
    const TensorTree* node = stack.back();
    stack.pop();
    if (node->is_leaf()) {
      if (node->leaf().requires_grad()) return true;
      continue;
    }
    for (const auto& e : node->children()) stack.push(&e.second);
  }
  return false;
}

// Integer buffers stay per leaf: an integer kernel can fail half-way (division by zero),
// possibly on padding, where the per-leaf loop would not.
bool flat_dtype(at::ScalarType t) {
  return at::isFloatingType(t) || at::isComplexType(t) || t == at::kBool;
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
      if (!flat_dtype(c->buffers()[g].scalar_type()) ||
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

// The operand rows of every group, as map_leaves' Zip gives them per leaf (one row per group,
// so groups may run on lanes concurrently).
class Rows {
 public:
  Rows(const CallOptions& o, c10::ArrayRef<Operand> args,
       const std::vector<const ConsolidatedTree*>& src)
      : args_(args), src_(src), wrapped_(args.size()) {
    for (const ConsolidatedTree* c : src)
      if (c) groups_ = c->buffers().size();
    std::vector<const at::Tensor*> base(args.size(), &undefined_);
    for (std::size_t k = 0; k < args.size(); ++k) {
      if (args[k].kind() == Operand::Kind::tensor) base[k] = &args[k].tensor();
      if (args[k].kind() == Operand::Kind::scalar && o.wrap_scalars) {
        wrapped_[k] = at::native::wrapped_scalar_tensor(args[k].scalar());
        base[k] = &wrapped_[k];
      }
    }
    rows_.reserve(groups_ * args.size());
    for (std::size_t g = 0; g < groups_; ++g)
      for (std::size_t k = 0; k < args.size(); ++k)
        rows_.push_back(src[k] ? &src[k]->buffers()[g] : base[k]);
  }
  std::size_t groups() const noexcept { return groups_; }
  LeafArgs group(std::size_t g) const {
    return LeafArgs(rows_.data() + g * args_.size(), args_.data(), g);
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
  c10::ArrayRef<Operand> args_;
  const std::vector<const ConsolidatedTree*>& src_;
  at::Tensor undefined_;
  std::vector<at::Tensor> wrapped_;
  std::vector<const at::Tensor*> rows_;
  std::size_t groups_ = 0;
};

std::string group_label(const ConsolidatedTree& c, std::size_t g) {
  const at::Tensor& b = c.buffers()[g];
  return "buffer " + std::to_string(g) + " (" + std::string(c10::toString(b.scalar_type())) + ", " +
         b.device().str() + ")";
}

// One leaf call per group through the runtime (so asyncs scopes and the policy see it).
void run_groups(const CallOptions& o, const Rows& rows, const ConsolidatedTree& layout_src,
                c10::function_ref<void(std::size_t)> run_group) {
  auto run = [&](std::size_t g) { run_group(g); };
  auto label = [&](std::size_t g) { return group_label(layout_src, g); };
  auto cost = [&](std::size_t g) {
    const double b = static_cast<double>(layout_src.layout().group_numel(g)) *
                     static_cast<double>(layout_src.buffers()[g].element_size());
    return runtime::LeafCost{b / 4, 2 * b};
  };
  runtime::LeafCall call{o.op, rows.groups(), run, label, cost};
  call.device = layout_src.buffers()[0].device();
  call.dtype = layout_src.buffers()[0].scalar_type();
  runtime::run(call);
}

}  // namespace

std::optional<TreeTensor> flat_map(const CallOptions& o, c10::ArrayRef<Operand> args, LeafFn f) {
  const auto src = plan(o, args, /*allocates=*/true);
  if (src.empty()) return std::nullopt;
  const ConsolidatedTree* first = nullptr;
  for (const ConsolidatedTree* c : src)
    if (c && !first) first = c;
  Rows rows(o, args, src);
  rows.await(0);
  std::vector<at::Tensor> out(rows.groups());
  try {
    run_groups(o, rows, *first, [&](std::size_t g) { out[g] = f(rows.group(g)); });
  } catch (...) {
    return std::nullopt;  // the per-leaf path runs it again and names the failing leaf
  }
  for (std::size_t g = 0; g < out.size(); ++g)
    if (!out[g].defined() || out[g].dim() != 1 ||
        out[g].numel() != first->layout().group_numel(g) || !out[g].is_contiguous())
      return std::nullopt;  // not elementwise on this input after all
  return consolidated_tree(first->layout_ptr(), std::move(out));
}

bool flat_update(const CallOptions& o, c10::ArrayRef<Operand> args, LeafUpdate f) {
  if (args.empty() || !args[0].is_tree()) return false;
  const auto src = plan(o, args, /*allocates=*/false);
  if (src.empty()) return false;
  Rows rows(o, args, src);
  rows.await(o.written);
  std::vector<std::uint8_t> done(rows.groups(), 0);
  try {
    run_groups(o, rows, *src[0], [&](std::size_t g) {
      f(rows.group(g));
      done[g] = 1;
    });
  } catch (...) {
    // Floating kernels check their operands before writing: when no group finished, nothing
    // was written, and the per-leaf path runs it again and names the failing leaf.
    std::string updated;
    for (std::size_t g = 0; g < done.size(); ++g)
      if (done[g]) updated += (updated.empty() ? "" : ", ") + std::to_string(g);
    if (updated.empty()) return false;
    runtime::rethrow_with_context(std::current_exception(),
                                  "in-place " + std::string(o.op) + " (flat): buffers {" + updated +
                                      "} were updated, the others not");
  }
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
