#pragma once
// The tree calls the benchmark times. The Adam step goes through the runtime's single dispatch
// point until TreeTensor's optimizer step lands.

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

#include "treetensor/runtime/dispatch.hpp"
#include "treetensor/tensor/ops.hpp"
#include "treetensor/tree/tree.hpp"

namespace treetensor::bench {

using TensorTree = treetensor::TensorTree;

/// Leaf-wise at::matmul(a, b) under the current stream mode: TreeTensor's matmul.
inline TensorTree tree_matmul(const TensorTree& a, const TensorTree& b) {
  return treetensor::matmul(a, b);
}

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
