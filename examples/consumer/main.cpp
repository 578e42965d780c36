// Uses the installed treetensor package: a tree of tensors, one leaf-wise op, one check.
#include <treetensor/tree/tree.hpp>
#include <treetensor/runtime/dispatch.hpp>

#include <ATen/ATen.h>

#include <iostream>
#include <vector>

int main() {
  using treetensor::tree::Tree;
  Tree<at::Tensor> t = {{"a", at::ones({2})}, {"x", {{"c", at::full({3}, 2.0)}}}};
  auto flat = treetensor::tree::flatten(t);
  std::vector<at::Tensor> out(flat.leaves.size());
  treetensor::runtime::LeafCall call;
  call.op = "mul";
  call.leaves = out.size();
  auto run = [&](std::size_t i) { out[i] = flat.leaves[i] * 2; };
  auto label = [&](std::size_t i) { return flat.spec.paths()[i].str(); };
  call.run = run;
  call.label = label;
  treetensor::runtime::run(call);
  auto doubled = treetensor::tree::unflatten(flat.spec, out);
  const bool ok = doubled.at("x.c").leaf().equal(at::full({3}, 4.0));
  std::cout << "consumer: " << (ok ? "ok" : "wrong values") << '\n';
  return ok ? 0 : 1;
}
