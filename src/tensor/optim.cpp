// Adam over trees: tree-op form and PyTorch's foreach form (same per-tensor arithmetic).
#include "treetensor/tensor/optim.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "tensor/flat.hpp"
#include "tensor/optim_kernels.hpp"
#include "treetensor/asyncs/operands.hpp"
#include "treetensor/asyncs/thread.hpp"
#include "treetensor/runtime/dispatch.hpp"
#include "treetensor/runtime/stream.hpp"
#include "treetensor/tensor/consolidate.hpp"
#include "treetensor/tensor/dispatch.hpp"
#include "treetensor/tensor/dtype.hpp"
#include "treetensor/tensor/ops.hpp"

namespace treetensor {
namespace {

struct Corrections {
  double step_size;   // lr / (1 - beta1^t)
  double bias2_sqrt;  // sqrt(1 - beta2^t)
};

Corrections corrections(const AdamOptions& o, int64_t step) {
  o.validate();
  if (step < 1) throw std::invalid_argument("adam: step must be >= 1, got " + std::to_string(step));
  const double t = static_cast<double>(step);
  return {o.lr() / (1 - std::pow(o.beta1(), t)), std::sqrt(1 - std::pow(o.beta2(), t))};
}

std::string dtype_name(c10::ScalarType t) {
  return torch_dtype_name(t).value_or(c10::toString(t));
}

// What is wrong with one leaf's operand `name` next to its parameter `p`, or "": every state
// and gradient leaf must have the parameter's dtype, device and shape (torch.optim's
// per-tensor forms refuse the same; ATen's in-place kernels assert on some mixes).
std::string mismatch(std::string_view name, const at::Tensor& x, const at::Tensor& p) {
  const std::string who(name);
  if (!x.defined()) return who + " is an undefined tensor";
  if (x.scalar_type() != p.scalar_type())
    return who + " has dtype " + dtype_name(x.scalar_type()) + ", expected " +
           dtype_name(p.scalar_type()) + " (the dtype of params)";
  if (x.device() != p.device())
    return who + " is on " + x.device().str() + ", expected " + p.device().str() +
           " (the device of params)";
  if (!x.sizes().equals(p.sizes()))
    return who + " has shape " + c10::str(x.sizes()) + ", expected " + c10::str(p.sizes()) +
           " (the shape of params)";
  return {};
}

// The check of every leaf of an optimizer call whose args[0] is params and args[k] is named
// names[k] (CallOptions::check: nothing is updated when a leaf fails it).
std::string leaf_mismatch(const detail::LeafArgs& a, c10::ArrayRef<std::string_view> names) {
  for (std::size_t k = 1; k < names.size(); ++k)
    if (std::string problem = mismatch(names[k], a.t(k), a.t(0)); !problem.empty()) return problem;
  return {};
}

// adam_step_foreach zips nothing: the same structure rule and leaf check on flattened trees.
void require_same(const char* op, const TensorTree& params, const TensorTree& x,
                  std::string_view name) {
  const auto p = tree::flatten_refs(params), f = tree::flatten_refs(x);
  if (!(p.spec == f.spec))
    throw tree::StructureError(
        {}, std::string(op) + ": " + std::string(name) + " does not have the structure of params");
  for (std::size_t i = 0; i < p.leaves.size(); ++i)
    if (std::string problem = mismatch(name, *f.leaves[i], *p.leaves[i]); !problem.empty())
      throw std::invalid_argument(std::string(op) + ": at '" + p.spec.paths()[i].describe() +
                                  "': " + problem);
}

}  // namespace

void AdamOptions::validate() const {
  auto check = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("AdamOptions: " + what);
  };
  check(lr_ >= 0, "lr must be >= 0, got " + std::to_string(lr_));
  check(beta1_ >= 0 && beta1_ < 1, "beta1 must be in [0, 1), got " + std::to_string(beta1_));
  check(beta2_ >= 0 && beta2_ < 1, "beta2 must be in [0, 1), got " + std::to_string(beta2_));
  check(eps_ >= 0, "eps must be >= 0, got " + std::to_string(eps_));
  check(weight_decay_ >= 0, "weight_decay must be >= 0, got " + std::to_string(weight_decay_));
}

// One tree call whose leaf job runs every stage on its own tensors while they are in cache
// (a stage-by-stage tree form streamed the whole model through memory seven times and ran at
// 0.78x the hand-written loop on ResNet-50). The fused form is PyTorch's foreach Adam.
void adam_step(TreeTensor& params, const TensorTree& grads, TreeTensor& exp_avg,
               TreeTensor& exp_avg_sq, int64_t step, const AdamOptions& o) {
  const Corrections c = corrections(o, step);
  at::NoGradGuard no_grad;
  const double b1 = o.beta1(), b2 = o.beta2(), wd = o.weight_decay(), eps = o.eps();
  auto leaf = [&](const detail::LeafArgs& a) {
    const at::Tensor &p = a.t(0), &m = a.t(1), &v = a.t(2);
    const at::Tensor g = wd != 0 ? a.t(3).add(p, wd) : a.t(3);
    m.mul_(b1).add_(g, 1 - b1);
    v.mul_(b2).addcmul_(g, g, 1 - b2);
    const at::Tensor denom = (v.sqrt() / c.bias2_sqrt).add_(eps);
    p.addcdiv_(m, denom, -c.step_size);
  };
  auto fused = [&](const detail::FusedArgs& a) {
    if (!a.foreach_compatible()) return false;
    const at::TensorList p = a.column(0), m = a.column(1), v = a.column(2);
    std::vector<at::Tensor> g = a.column(3).vec();
    if (wd != 0) g = at::_foreach_add(g, p, wd);
    at::_foreach_mul_(m, b1);
    at::_foreach_add_(m, g, 1 - b1);
    at::_foreach_mul_(v, b2);
    at::_foreach_addcmul_(v, g, g, 1 - b2);
    std::vector<at::Tensor> denom = at::_foreach_sqrt(v);
    at::_foreach_div_(denom, c.bias2_sqrt);
    at::_foreach_add_(denom, eps);
    at::_foreach_addcdiv_(p, m, denom, -c.step_size);
    return true;
  };
  static constexpr std::string_view names[] = {"params", "exp_avg", "exp_avg_sq", "grads"};
  auto check = [](const detail::LeafArgs& a) { return leaf_mismatch(a, names); };
  detail::CallOptions call{"adam_step"};
  call.arg_names = names;
  call.check = check;
  call.written = 3;         // params, exp_avg, exp_avg_sq
  call.elementwise = true;  // consolidated trees: one call per buffer per stage (flat)
  const Operand args[] = {params, exp_avg, exp_avg_sq, grads};
  detail::update_leaves(call, args, leaf, fused);
}

void adam_step_foreach(TreeTensor& params, const TensorTree& grads, TreeTensor& exp_avg,
                       TreeTensor& exp_avg_sq, int64_t step, const AdamOptions& o) {
  const Corrections c = corrections(o, step);
  const char* op = "adam_step_foreach";
  require_same(op, params, grads, "grads");
  require_same(op, params, exp_avg, "exp_avg");
  require_same(op, params, exp_avg_sq, "exp_avg_sq");
  at::NoGradGuard no_grad;
  const auto p = tree::flatten(params).leaves, m = tree::flatten(exp_avg).leaves,
             v = tree::flatten(exp_avg_sq).leaves;
  std::vector<at::Tensor> g = tree::flatten(grads).leaves;
  if (o.weight_decay() != 0) g = at::_foreach_add(g, p, o.weight_decay());
  at::_foreach_mul_(m, o.beta1());
  at::_foreach_add_(m, g, 1 - o.beta1());
  at::_foreach_mul_(v, o.beta2());
  at::_foreach_addcmul_(v, g, g, 1 - o.beta2());
  std::vector<at::Tensor> denom = at::_foreach_div(at::_foreach_sqrt(v), c.bias2_sqrt);
  at::_foreach_add_(denom, o.eps());
  at::_foreach_addcdiv_(p, m, denom, -c.step_size);
}

// ---- single-pass kernels ---------------------------------------------------------------------
void SgdOptions::validate() const {
  auto check = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("SgdOptions: " + what);
  };
  check(lr_ >= 0, "lr must be >= 0, got " + std::to_string(lr_));
  check(momentum_ >= 0, "momentum must be >= 0, got " + std::to_string(momentum_));
  check(weight_decay_ >= 0, "weight_decay must be >= 0, got " + std::to_string(weight_decay_));
  check(!nesterov_ || (momentum_ > 0 && dampening_ == 0),
        "nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)");
}

namespace {

constexpr int64_t kPiece = 1 << 18;  // elements per lane job over a consolidated buffer

// The groups of every tree when all are consolidated with one layout whose buffers the
// kernels take (dtype, device), else empty: then the per-leaf path runs.
std::vector<std::vector<ConsolidatedGroup>> common_layout(
    std::initializer_list<const TensorTree*> trees) {
  std::vector<std::vector<ConsolidatedGroup>> out;
  for (const TensorTree* t : trees) {
    out.push_back(consolidated_groups(*t));
    const auto& first = out.front();
    const auto& g = out.back();
    if (g.empty() || g.size() != first.size()) return {};
    for (std::size_t k = 0; k < g.size(); ++k)
      if (g[k].ranges != first[k].ranges ||
          g[k].buffer.scalar_type() != first[k].buffer.scalar_type() ||
          g[k].buffer.device() != first[k].buffer.device() || !detail::kernel_ready({&g[k].buffer}))
        return {};
  }
  return out;
}

// Under the default (linear) mode an ATen kernel runs on the caller and ATen's intra-op
// threads, and so does torch's fused Adam. A single-pass step over CPU tensors takes the same
// share while this lives: over more than one piece of work, as many lanes as the caller has
// intra-op threads (its pieces over buffers, its leaves per leaf). Inside a lane or a pinned
// asyncs worker that is one (DESIGN.md §6, §10); a step queued from a pending asyncs scope runs
// as its worker's kernels would; another mode (stream(M), automatic) is the user's choice.
// `elements()` is asked only when the share could apply.
class IntraOpShare {
 public:
  template <class Elements>
  explicit IntraOpShare(const Elements& elements) {
    if (runtime::current_stream_mode() != runtime::StreamMode{} || asyncs::pending_target()) return;
    const auto lanes =
        std::min<std::size_t>(std::size_t(at::get_num_threads()), runtime::max_lanes);
    if (lanes > 1 && elements() > kPiece) guard_.emplace(lanes);
  }

 private:
  std::optional<runtime::StreamGuard> guard_;
};

// The elements of a tree's leaves when all are on the CPU, else 0 (a CUDA step keeps the
// caller's stream: lanes would move it onto theirs, DESIGN.md §7).
int64_t cpu_elements(const TensorTree& t) {
  int64_t n = 0;
  for (const at::Tensor* x : tree::flatten_refs(t).leaves) {
    if (!x->defined() || !x->device().is_cpu()) return 0;
    n += x->numel();
  }
  return n;
}

// Runs kernel(group, begin, end) over every leaf range of the consolidated groups, in pieces
// of at most kPiece elements, through runtime::run (so the stream mode spreads them; the
// default mode as IntraOpShare says).
void run_over_buffers(std::string_view op, const std::vector<ConsolidatedGroup>& groups,
                      double bytes_per_element,
                      const std::function<void(std::size_t, int64_t, int64_t)>& kernel) {
  struct Piece {
    std::size_t group;
    int64_t begin, end;
  };
  std::vector<Piece> pieces;
  int64_t elements = 0;
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (const auto& [offset, n] : groups[g].ranges) {
      elements += n;
      for (int64_t b = offset; b < offset + n; b += kPiece)
        pieces.push_back({g, b, std::min(b + kPiece, offset + n)});
    }
  runtime::LeafCall call;
  call.op = op;
  call.leaves = pieces.size();
  auto run = [&](std::size_t i) { kernel(pieces[i].group, pieces[i].begin, pieces[i].end); };
  auto label = [&](std::size_t i) {
    return "elements [" + std::to_string(pieces[i].begin) + ", " + std::to_string(pieces[i].end) +
           ") of buffer " + std::to_string(pieces[i].group);
  };
  auto cost = [&](std::size_t i) {
    const double n = double(pieces[i].end - pieces[i].begin);
    return runtime::LeafCost{10 * n, bytes_per_element * n};
  };
  call.run = run;
  call.label = label;
  call.cost = cost;
  if (!groups.empty()) {
    call.device = groups[0].buffer.device();
    call.dtype = groups[0].buffer.scalar_type();
  }
  const IntraOpShare share([&] { return elements; });
  runtime::run(call);
}

// Pending asyncs work on the buffers (DESIGN.md §10): the per-leaf path gets this from
// update_leaves.
void await_buffers(const std::vector<std::vector<ConsolidatedGroup>>& layout, std::size_t written) {
  if (!asyncs::tracking_active()) return;
  std::vector<at::Tensor> reads, writes;
  for (std::size_t t = 0; t < layout.size(); ++t)
    for (const auto& g : layout[t]) (t < written ? writes : reads).push_back(g.buffer);
  asyncs::await_operands(reads, writes);
}

void adam_single_pass(const char* op, TreeTensor& params, const TensorTree& grads,
                      TreeTensor& exp_avg, TreeTensor& exp_avg_sq, int64_t step,
                      const AdamOptions& o, TreeTensor* max_exp_avg_sq, bool decoupled) {
  const Corrections c = corrections(o, step);
  if (o.amsgrad() && !max_exp_avg_sq)
    throw std::invalid_argument(std::string(op) + ": amsgrad needs a max_exp_avg_sq tree");
  detail::AdamScalars s{o.beta1(),
                        o.beta2(),
                        o.eps(),
                        o.weight_decay(),
                        c.step_size,
                        c.bias2_sqrt,
                        1 - o.lr() * o.weight_decay(),
                        decoupled,
                        o.amsgrad(),
                        o.maximize()};
  at::NoGradGuard no_grad;
  TreeTensor& vmax = o.amsgrad() ? *max_exp_avg_sq : exp_avg_sq;  // unused without amsgrad
  const auto layout = common_layout({&params, &exp_avg, &exp_avg_sq, &vmax, &grads});
  if (!layout.empty()) {
    await_buffers(layout, 4);
    run_over_buffers(
        op, layout[0], o.amsgrad() ? 36 : 28, [&](std::size_t g, int64_t b, int64_t e) {
          detail::adam_kernel(layout[0][g].buffer, layout[4][g].buffer, layout[1][g].buffer,
                              layout[2][g].buffer, layout[3][g].buffer, s, b, e);
        });
    for (const TensorTree* t : {&params, &exp_avg, &exp_avg_sq, &vmax}) detail::mark_written(*t);
    return;
  }
  auto leaf = [&](const detail::LeafArgs& a) {
    const at::Tensor &p = a.t(0), &m = a.t(1), &v = a.t(2), &vm = a.t(3), &g = a.t(4);
    if (detail::kernel_ready({&p, &m, &v, &vm, &g})) {
      detail::adam_kernel(p, g, m, v, vm, s, 0, p.numel());
      for (const at::Tensor* x : {&p, &m, &v, &vm}) x->unsafeGetTensorImpl()->bump_version();
      return;
    }
    // Leaves the kernel does not take (non-contiguous, other dtypes): the same math in at:: ops.
    at::Tensor grad = o.maximize() ? g.neg() : g;
    if (!decoupled && s.weight_decay != 0) grad = grad.add(p, s.weight_decay);
    if (decoupled && s.weight_decay != 0) p.mul_(s.decay_factor);
    m.mul_(s.beta1).add_(grad, 1 - s.beta1);
    v.mul_(s.beta2).addcmul_(grad, grad, 1 - s.beta2);
    if (o.amsgrad()) at::maximum_out(const_cast<at::Tensor&>(vm), vm, v);
    const at::Tensor denom = ((o.amsgrad() ? vm : v).sqrt() / s.bias2_sqrt).add_(s.eps);
    p.addcdiv_(m, denom, -s.step_size);
  };
  // Without amsgrad vmax is exp_avg_sq again: its errors name exp_avg_sq.
  const std::string_view names[] = {"params", "exp_avg", "exp_avg_sq",
                                    o.amsgrad() ? "max_exp_avg_sq" : "exp_avg_sq", "grads"};
  auto check = [&](const detail::LeafArgs& a) { return leaf_mismatch(a, names); };
  detail::CallOptions call{op};
  call.arg_names = names;
  call.check = check;
  call.written = 4;
  const Operand args[] = {params, exp_avg, exp_avg_sq, vmax, grads};
  const IntraOpShare share([&] { return cpu_elements(params); });
  detail::update_leaves(call, args, leaf);
}

}  // namespace

void adam_step_single_pass(TreeTensor& params, const TensorTree& grads, TreeTensor& exp_avg,
                           TreeTensor& exp_avg_sq, int64_t step, const AdamOptions& o,
                           TreeTensor* max_exp_avg_sq) {
  adam_single_pass("adam_step_single_pass", params, grads, exp_avg, exp_avg_sq, step, o,
                   max_exp_avg_sq, false);
}

void adamw_step_single_pass(TreeTensor& params, const TensorTree& grads, TreeTensor& exp_avg,
                            TreeTensor& exp_avg_sq, int64_t step, const AdamOptions& o,
                            TreeTensor* max_exp_avg_sq) {
  adam_single_pass("adamw_step_single_pass", params, grads, exp_avg, exp_avg_sq, step, o,
                   max_exp_avg_sq, true);
}

void sgd_step_single_pass(TreeTensor& params, const TensorTree& grads, TreeTensor& momentum_buffer,
                          int64_t step, const SgdOptions& o) {
  o.validate();
  if (step < 1)
    throw std::invalid_argument("sgd_step_single_pass: step must be >= 1, got " +
                                std::to_string(step));
  const detail::SgdScalars s{o.lr(),       o.momentum(), o.dampening(), o.weight_decay(),
                             o.nesterov(), o.maximize(), step == 1};
  at::NoGradGuard no_grad;
  const bool momentum = o.momentum() != 0;
  TreeTensor& buf = momentum ? momentum_buffer : params;  // unused without momentum
  const auto layout = common_layout({&params, &buf, &grads});
  if (!layout.empty()) {
    await_buffers(layout, 2);
    run_over_buffers("sgd_step_single_pass", layout[0], momentum ? 20 : 12,
                     [&](std::size_t g, int64_t b, int64_t e) {
                       detail::sgd_kernel(layout[0][g].buffer, layout[2][g].buffer,
                                          momentum ? layout[1][g].buffer : at::Tensor(), s, b, e);
                     });
    detail::mark_written(params);
    if (momentum) detail::mark_written(buf);
    return;
  }
  auto leaf = [&](const detail::LeafArgs& a) {
    const at::Tensor &p = a.t(0), &b = a.t(1), &g = a.t(2);
    if (detail::kernel_ready({&p, &b, &g})) {
      detail::sgd_kernel(p, g, momentum ? b : at::Tensor(), s, 0, p.numel());
      p.unsafeGetTensorImpl()->bump_version();
      if (momentum) b.unsafeGetTensorImpl()->bump_version();
      return;
    }
    at::Tensor d = o.maximize() ? g.neg() : g;
    if (s.weight_decay != 0) d = d.add(p, s.weight_decay);
    if (momentum) {
      if (s.first_step)
        b.copy_(d);
      else
        b.mul_(s.momentum).add_(d, 1 - s.dampening);
      d = s.nesterov ? d.add(b, s.momentum) : b;
    }
    p.add_(d, -s.lr);
  };
  const std::string_view names[] = {"params", momentum ? "momentum_buffer" : "params", "grads"};
  auto check = [&](const detail::LeafArgs& a) { return leaf_mismatch(a, names); };
  detail::CallOptions call{"sgd_step_single_pass"};
  call.arg_names = names;
  call.check = check;
  call.written = momentum ? 2 : 1;
  const Operand args[] = {params, buf, grads};
  const IntraOpShare share([&] { return cpu_elements(params); });
  detail::update_leaves(call, args, leaf);
}

}  // namespace treetensor
