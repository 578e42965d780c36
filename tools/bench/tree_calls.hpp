#pragma once
// The tree calls the benchmark times. Interim: a leaf-wise matmul through the runtime's single
// dispatch point, until TreeTensor's matmul lands (then this forwards to it).

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

#include "treetensor/runtime/dispatch.hpp"
#include "treetensor/tree/tree.hpp"

namespace treetensor::bench {

using TensorTree = tree::Tree<at::Tensor>;

/// Leaf-wise at::matmul(a, b) under the current stream mode; a and b have the same keys.
inline TensorTree tree_matmul(const TensorTree& a, const TensorTree& b) {
  auto fa = tree::flatten_refs(a);
  auto fb = tree::flatten_refs(b);
  std::vector<at::Tensor> out(fa.leaves.size());
  auto paths = fa.spec.paths();
  auto run = [&](std::size_t i) { out[i] = at::matmul(*fa.leaves[i], *fb.leaves[i]); };
  auto label = [&](std::size_t i) { return paths[i].describe(); };
  runtime::LeafCall call{.op = "matmul", .leaves = out.size(), .run = run, .label = label};
  runtime::run(call);
  return tree::unflatten(fa.spec, std::move(out));
}

}  // namespace treetensor::bench

namespace treetensor::bench {

/// The four trees of an Adam step (same structure).
struct AdamTrees {
  TensorTree params, grads, exp_avg, exp_avg_sq;
};

/// One Adam step (torch.optim.Adam arithmetic, L2 weight decay, bias correction for `step`)
/// over every leaf, in place, under the current stream mode.
inline void tree_adam_step(AdamTrees& t, std::int64_t step, double lr, double beta1, double beta2,
                           double eps, double weight_decay) {
  auto p = tree::flatten_mut(t.params), m = tree::flatten_mut(t.exp_avg),
       v = tree::flatten_mut(t.exp_avg_sq);
  auto g = tree::flatten_refs(t.grads);
  auto paths = p.spec.paths();
  const double bc1 = 1 - std::pow(beta1, double(step)), bc2 = 1 - std::pow(beta2, double(step));
  auto run = [&](std::size_t i) {
    at::Tensor grad = *g.leaves[i];
    if (weight_decay != 0) grad = grad.add(*p.leaves[i], weight_decay);
    m.leaves[i]->mul_(beta1).add_(grad, 1 - beta1);
    v.leaves[i]->mul_(beta2).addcmul_(grad, grad, 1 - beta2);
    at::Tensor denom = (v.leaves[i]->sqrt() / std::sqrt(bc2)).add_(eps);
    p.leaves[i]->addcdiv_(*m.leaves[i], denom, -lr / bc1);
  };
  auto label = [&](std::size_t i) { return paths[i].describe(); };
  runtime::LeafCall call{.op = "adam", .leaves = paths.size(), .run = run, .label = label};
  runtime::run(call);
}

}  // namespace treetensor::bench
