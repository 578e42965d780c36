#pragma once
// Helpers of the tensor tests: strategies to parametrise over, random trees, leaf-by-leaf
// comparison against hand-written loops.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <concepts>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "treetensor/runtime/stream.hpp"
#include "treetensor/tensor/tensor.hpp"

namespace tt_test {

namespace rt = treetensor::runtime;
using treetensor::TensorTree;
using treetensor::TreeTensor;

/// The execution strategies every value test runs under (DESIGN.md §5).
inline std::vector<rt::StreamMode> strategies() {
  return {rt::StreamMode::of(1), rt::StreamMode::of(2), rt::StreamMode::of(4),
          rt::StreamMode::of(rt::automatic), rt::StreamMode::of(rt::fused)};
}

inline std::string strategy_name(const ::testing::TestParamInfo<rt::StreamMode>& info) {
  std::string s = info.param.to_string();
  std::string out;
  for (char c : s)
    if (std::isalnum(static_cast<unsigned char>(c))) out += c;
  return out;
}

/// The leaves of a tree in flatten order, and their paths.
inline std::vector<at::Tensor> leaves(const TensorTree& t) {
  return treetensor::tree::flatten(t).leaves;
}
inline std::vector<std::string> paths(const TensorTree& t) {
  std::vector<std::string> out;
  for (const auto& p : t.paths()) out.push_back(p.str());
  return out;
}

/// Expects the same structure and, leaf by leaf, the same dtype, shape and values (bitwise
/// with exact = true, allclose otherwise; NaN equals NaN).
inline void expect_same(const TensorTree& got, const TensorTree& want, bool exact = true,
                        double rtol = 1e-5, double atol = 1e-6) {
  ASSERT_EQ(paths(got), paths(want));
  const auto g = leaves(got), w = leaves(want);
  const auto p = paths(want);
  for (std::size_t i = 0; i < g.size(); ++i) {
    SCOPED_TRACE("leaf " + p[i]);
    ASSERT_TRUE(g[i].defined());
    ASSERT_EQ(g[i].scalar_type(), w[i].scalar_type());
    ASSERT_EQ(g[i].sizes(), w[i].sizes());
    if (exact) {
      const bool nan_ok = at::isFloatingType(w[i].scalar_type());
      EXPECT_TRUE(nan_ok ? at::allclose(g[i], w[i], 0, 0, true) : at::equal(g[i], w[i]))
          << g[i] << "\nvs\n"
          << w[i];
    } else {
      EXPECT_TRUE(at::allclose(g[i], w[i], rtol, atol, true)) << g[i] << "\nvs\n" << w[i];
    }
  }
}

/// Expects `got` (a tree matmul / mm / dot of `a` and `b`) to agree with `want` (the
/// hand-written loop) leaf by leaf within the matmul rounding bound (DESIGN.md §5): a lane runs
/// BLAS with one thread and the fused form is one bmm, so the summation order may differ.
/// `b_leaf(i)` gives the right factor of leaf i.
template <class BLeaf>
requires std::invocable<BLeaf, std::size_t>
void expect_matmul_agrees(const TensorTree& got, const TensorTree& want, const TensorTree& a,
                          BLeaf&& b_leaf) {
  ASSERT_EQ(paths(got), paths(want));
  const auto g = leaves(got), w = leaves(want), l = leaves(a);
  const auto p = paths(want);
  for (std::size_t i = 0; i < g.size(); ++i) {
    const auto agreement = treetensor::rounding::compare_matmul(g[i], w[i], l[i], b_leaf(i));
    EXPECT_TRUE(agreement.holds()) << "leaf " << p[i] << ": " << agreement.describe();
  }
}
inline void expect_matmul_agrees(const TensorTree& got, const TensorTree& want, const TensorTree& a,
                                 const TensorTree& b) {
  const auto r = leaves(b);
  expect_matmul_agrees(got, want, a, [&](std::size_t i) { return r[i]; });
}

/// The hand-written loop: f(leaf...) over trees of equal structure, as a LibTorch user writes.
template <class F>
TreeTensor native(F&& f, const TensorTree& a) {
  auto l = leaves(a);
  for (auto& x : l) x = f(x);
  return treetensor::tree::unflatten(treetensor::tree::flatten(a).spec, l);
}
template <class F>
TreeTensor native(F&& f, const TensorTree& a, const TensorTree& b) {
  auto la = leaves(a), lb = leaves(b);
  for (std::size_t i = 0; i < la.size(); ++i) la[i] = f(la[i], lb[i]);
  return treetensor::tree::unflatten(treetensor::tree::flatten(a).spec, la);
}

/// A random structure with up to `max_leaves` leaves, depth up to 4, leaf shapes from
/// 0-d to 3-d (some empty when allow_empty).
inline treetensor::ShapeTree random_shapes(std::mt19937& rng, std::size_t max_leaves,
                                           bool allow_empty = true) {
  std::uniform_int_distribution<int> count(1, static_cast<int>(max_leaves));
  const int n = count(rng);
  std::vector<std::pair<std::string, treetensor::Shape>> items;
  for (int i = 0; i < n; ++i) {
    std::string path;
    const int depth = std::uniform_int_distribution<int>(1, 3)(rng);
    for (int d = 0; d < depth; ++d) {
      if (d) path += '.';
      path += (d + 1 < depth ? "n" : "l") +
              std::to_string(std::uniform_int_distribution<int>(0, 5)(rng));
    }
    path += "_" + std::to_string(i);  // unique leaf names, never prefix of another path
    treetensor::Shape shape;
    const int dims = std::uniform_int_distribution<int>(0, 3)(rng);
    for (int d = 0; d < dims; ++d)
      shape.push_back(std::uniform_int_distribution<int>(allow_empty ? 0 : 1, 5)(rng));
    items.emplace_back(path, shape);
  }
  // "n3" may be both a node here and nowhere a leaf: leaf keys start with 'l', nodes with 'n'.
  return treetensor::tree::unflatten<treetensor::Shape>(items);
}

/// A tree of the given shapes filled from at::randn with the current default generator.
inline TreeTensor randn_tree(const treetensor::ShapeTree& shapes,
                             at::ScalarType dtype = at::kFloat) {
  return treetensor::tree::map([&](const treetensor::Shape& s) { return at::randn(s).to(dtype); },
                               shapes);
}

// The bound for results of libm-style functions (exp, log, sigmoid, ...) computed two ways
// (ATen's vectorised Sleef kernels vs a scalar or tiled path): glibc's documented maximum errors
// for these float/double functions are at most 2 ulp and Sleef's u10 variants at most 1 ulp, so the
// two forms differ by at most 3 ulp of the result for a primitive; the composed ones (sigmoid =
// 1/(1+exp(-x)), rsqrt = 1/sqrt) add two roundings, each of which can double the relative error at
// most once: 2·(3+1) = 8 ulp. Elements whose reference is subnormal or zero are compared in units
// of the smallest normal.
inline void expect_within_ulps(const TensorTree& got, const TensorTree& want) {
  ASSERT_EQ(paths(got), paths(want));
  const auto g = leaves(got), w = leaves(want);
  for (std::size_t i = 0; i < g.size(); ++i) {
    SCOPED_TRACE("leaf " + paths(want)[i]);
    ASSERT_EQ(g[i].scalar_type(), w[i].scalar_type());
    ASSERT_EQ(g[i].sizes(), w[i].sizes());
    const bool dbl = w[i].scalar_type() == at::kDouble;
    const double eps = dbl ? std::ldexp(1.0, -52) : std::ldexp(1.0, -23);
    const double tiny = dbl ? 2.2250738585072014e-308 : 1.1754943508222875e-38;
    const at::Tensor a = g[i].to(at::kDouble), b = w[i].to(at::kDouble);
    const at::Tensor nan_same = a.isnan() == b.isnan();
    EXPECT_TRUE(nan_same.all().item<bool>());
    const at::Tensor both = ~(a.isnan() | b.isnan());
    const at::Tensor scale = at::clamp_min(b.abs(), tiny) * eps;
    const at::Tensor ulps = at::where(both & (a != b), (a - b).abs() / scale, at::zeros_like(a));
    EXPECT_LE(ulps.numel() ? ulps.max().item<double>() : 0.0, 8.0);
  }
}

}  // namespace tt_test
