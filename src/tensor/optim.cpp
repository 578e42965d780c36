// Adam over trees: tree-op form and PyTorch's foreach form (same per-tensor arithmetic).
#include "treetensor/tensor/optim.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "treetensor/tensor/dispatch.hpp"
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

void require_same(const TensorTree& a, const TensorTree& b, const char* what) {
  if (!(tree::flatten_refs(a).spec == tree::flatten_refs(b).spec))
    throw tree::StructureError(
        {}, std::string("adam_step_foreach: ") + what + " does not have the structure of params");
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
  detail::CallOptions call{"adam_step"};
  call.written = 3;  // params, exp_avg, exp_avg_sq
  const Operand args[] = {params, exp_avg, exp_avg_sq, grads};
  detail::update_leaves(call, args, leaf, fused);
}

void adam_step_foreach(TreeTensor& params, const TensorTree& grads, TreeTensor& exp_avg,
                       TreeTensor& exp_avg_sq, int64_t step, const AdamOptions& o) {
  const Corrections c = corrections(o, step);
  require_same(params, grads, "grads");
  require_same(params, exp_avg, "exp_avg");
  require_same(params, exp_avg_sq, "exp_avg_sq");
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

}  // namespace treetensor
