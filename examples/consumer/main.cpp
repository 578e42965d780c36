// Uses the installed treetensor package: a tree of tensors, leaf-wise ops on two lanes, and a
// check against the hand-written loop.
#include <treetensor/treetensor.hpp>

#include <ATen/ATen.h>

#include <iostream>

int main() {
  namespace tt = treetensor;
  const tt::TreeTensor t = tt::randn({{"a", {2, 3}}, {"b", {{"x", {3, 4}}}}});
  tt::runtime::StreamGuard lanes(2);
  const tt::TreeTensor y = (t * 2 + 1).sigmoid();
  bool ok = true;
  for (const auto& path : t.paths()) {
    const at::Tensor expected = (t.at(path).leaf() * 2 + 1).sigmoid();
    ok = ok && y.at(path).leaf().equal(expected);
  }
  std::cout << y << "\nconsumer: " << (ok ? "ok" : "wrong values") << '\n';
  return ok ? 0 : 1;
}
