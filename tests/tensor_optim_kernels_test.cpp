// The single-pass optimizer kernels (DESIGN.md §12) against LibTorch's own torch::optim::Adam,
// AdamW and SGD: 10 steps on the same parameters and gradients for each option set, every
// element within a rounding bound derived by running error analysis; the per-leaf and the
// consolidated paths, under every strategy, bitwise equal to each other.
//
// The bound: the same 10 steps are run in float64 from the same float inputs and float-cast
// constants, carrying for every value a first-order bound on the error of a float computation
// of it (Higham, "Accuracy and Stability of Numerical Algorithms", §3.3 running error
// analysis): each operation adds u·|result| to the propagated input errors. Both the kernels
// and torch::optim (whose ATen kernels may fuse a multiply-add, which rounds less) lie within
// that bound of the float64 value, so within twice it of each other. The factor 1.01 covers
// the second-order terms first-order analysis drops (relative size ~u).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/optim.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "tensor/optim_kernels.hpp"
#include "tensor_test_util.hpp"
#include "treetensor/tensor/tensor.hpp"

namespace tt = treetensor;
using namespace tt_test;

namespace {

// A value computed in float64 with a bound on the error of computing it in float.
struct Tracked {
  double v = 0, e = 0;
};
double g_u = std::ldexp(1.0, -24);  // unit roundoff of the compute dtype

Tracked round(double v, double e) {
  return {v, e + g_u * std::abs(v)};
}
Tracked add(Tracked a, Tracked b) {
  return round(a.v + b.v, a.e + b.e);
}
Tracked scale(Tracked a, double c) {
  return round(a.v * c, std::abs(c) * a.e);
}
Tracked mul(Tracked a, Tracked b) {
  return round(a.v * b.v, std::abs(a.v) * b.e + std::abs(b.v) * a.e + a.e * b.e);
}
Tracked div(Tracked a, Tracked b) {
  const double z = a.v / b.v;
  return round(z, (a.e + std::abs(z) * b.e) / (std::abs(b.v) - b.e));
}
Tracked root(Tracked a) {
  const double z = std::sqrt(a.v);
  return round(z, a.e / (z + std::sqrt(std::max(a.v - a.e, 0.0))));
}
Tracked maximum(Tracked a, Tracked b) {
  return {std::max(a.v, b.v), std::max(a.e, b.e)};
}
// A Scalar cast to the compute type (float32 kernels; float64 keeps it).
double f(double x) {
  return g_u == std::ldexp(1.0, -24) ? double(float(x)) : x;
}

struct AdamCase {
  std::string name;
  double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0;
  bool amsgrad = false, maximize = false, decoupled = false;
};
struct SgdCase {
  std::string name;
  double lr = 0.1, momentum = 0, dampening = 0, wd = 0;
  bool nesterov = false, maximize = false;
};

// Leaves of 0, 1, 7 and 1025 elements (the vector tail) and a 2-D one.
TreeTensor params_tree(at::ScalarType dtype) {
  at::manual_seed(11);
  return tt::tree::map(
      [&](const tt::Shape& s) { return at::randn(s).to(dtype); },
      tt::ShapeTree{{"a", {0}}, {"b", {1}}, {"c", {7}}, {"d", {1025}}, {"e", {{"w", {33, 31}}}}});
}
std::vector<TreeTensor> grads_trees(const TreeTensor& p, int steps) {
  std::vector<TreeTensor> out;
  for (int s = 0; s < steps; ++s)
    out.push_back(tt::tree::map([](const at::Tensor& x) { return at::randn_like(x) * 0.1; }, p));
  return out;
}

// The float64 reference with error bounds, per leaf element.
struct AdamRef {
  std::vector<Tracked> p, m, v, vmax;
};
void adam_ref_step(AdamRef& r, const std::vector<double>& grad, const AdamCase& c, int step) {
  const double bc1 = 1 - std::pow(c.b1, step), bc2_sqrt = std::sqrt(1 - std::pow(c.b2, step));
  for (std::size_t i = 0; i < r.p.size(); ++i) {
    Tracked g{c.maximize ? -grad[i] : grad[i], 0};
    if (!c.decoupled && c.wd != 0) g = add(g, scale(r.p[i], f(c.wd)));
    if (c.decoupled && c.wd != 0) r.p[i] = scale(r.p[i], f(1 - c.lr * c.wd));
    r.m[i] = add(scale(r.m[i], f(c.b1)), scale(g, f(1 - c.b1)));
    r.v[i] = add(scale(r.v[i], f(c.b2)), mul(scale(g, f(1 - c.b2)), g));
    Tracked d = r.v[i];
    if (c.amsgrad) d = r.vmax[i] = maximum(r.vmax[i], r.v[i]);
    const Tracked denom = add(div(root(d), {f(bc2_sqrt), 0}), {f(c.eps), 0});
    r.p[i] = add(r.p[i], div(scale(r.m[i], f(-c.lr / bc1)), denom));
  }
}

std::vector<double> flat_values(const TensorTree& t) {
  std::vector<double> out;
  for (const auto& x : leaves(t)) {
    const at::Tensor d = x.detach().reshape({-1}).to(at::kDouble).contiguous();
    out.insert(out.end(), d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
  }
  return out;
}

// Every element of `got` and `theirs` within 1.01·e of the reference; returns the worst
// |got - theirs| / (2.02·e).
double check_against(const std::vector<double>& got, const std::vector<double>& theirs,
                     const std::vector<Tracked>& ref, const std::string& what) {
  double worst = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double bound = 1.01 * ref[i].e;
    EXPECT_LE(std::abs(got[i] - ref[i].v), bound) << what << " element " << i << " (ours)";
    EXPECT_LE(std::abs(theirs[i] - ref[i].v), bound)
        << what << " element " << i << " (torch::optim)";
    if (got[i] != theirs[i]) worst = std::max(worst, std::abs(got[i] - theirs[i]) / (2 * bound));
  }
  return worst;
}

std::vector<at::Tensor> torch_params(const TreeTensor& p) {
  std::vector<at::Tensor> out;
  for (const auto& x : leaves(p)) out.push_back(x.clone().requires_grad_(true));
  return out;
}

void set_grads(std::vector<at::Tensor>& params, const TreeTensor& g, bool negate) {
  const auto gl = leaves(g);
  for (std::size_t i = 0; i < params.size(); ++i)
    params[i].mutable_grad() = negate ? -gl[i] : gl[i].clone();
}

double run_adam_case(const AdamCase& c, at::ScalarType dtype, bool consolidated) {
  const int steps = 10;
  TreeTensor p = params_tree(dtype);
  const auto grads = grads_trees(p, steps);
  std::vector<at::Tensor> theirs = torch_params(p);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (c.decoupled)
    opt = std::make_unique<torch::optim::AdamW>(theirs, torch::optim::AdamWOptions(c.lr)
                                                            .betas({c.b1, c.b2})
                                                            .eps(c.eps)
                                                            .weight_decay(c.wd)
                                                            .amsgrad(c.amsgrad));
  else
    opt = std::make_unique<torch::optim::Adam>(theirs, torch::optim::AdamOptions(c.lr)
                                                           .betas({c.b1, c.b2})
                                                           .eps(c.eps)
                                                           .weight_decay(c.wd)
                                                           .amsgrad(c.amsgrad));
  TreeTensor m = tt::zeros_like(p), v = tt::zeros_like(p), vmax = tt::zeros_like(p);
  if (consolidated) {
    p = tt::consolidate(p);
    m = tt::consolidate(m);
    v = tt::consolidate(v);
    vmax = tt::consolidate(vmax);
  }
  AdamRef ref;
  for (double x : flat_values(p)) ref.p.push_back({x, 0});
  ref.m = ref.v = ref.vmax = std::vector<Tracked>(ref.p.size());
  const auto o = tt::AdamOptions()
                     .lr(c.lr)
                     .betas(c.b1, c.b2)
                     .eps(c.eps)
                     .weight_decay(c.wd)
                     .amsgrad(c.amsgrad)
                     .maximize(c.maximize);
  for (int s = 1; s <= steps; ++s) {
    const TreeTensor g = consolidated ? tt::consolidate(grads[s - 1]) : grads[s - 1];
    if (c.decoupled)
      tt::adamw_step_single_pass(p, g, m, v, s, o, c.amsgrad ? &vmax : nullptr);
    else
      tt::adam_step_single_pass(p, g, m, v, s, o, c.amsgrad ? &vmax : nullptr);
    set_grads(theirs, grads[s - 1], c.maximize);
    opt->step();
    adam_ref_step(ref, flat_values(grads[s - 1]), c, s);
  }
  std::vector<double> torch_values;
  for (const auto& x : theirs) {
    const at::Tensor d = x.detach().reshape({-1}).to(at::kDouble).contiguous();
    torch_values.insert(torch_values.end(), d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
  }
  return check_against(flat_values(p), torch_values, ref.p, c.name);
}

class OptimKernels : public ::testing::TestWithParam<rt::StreamMode> {
 protected:
  rt::StreamGuard guard_{GetParam()};
};

}  // namespace

TEST_P(OptimKernels, AdamAndAdamWAgreeWithTorchOptimToTheDerivedBound) {
  g_u = std::ldexp(1.0, -24);
  const std::vector<AdamCase> cases = {
      {"adam"},
      {"adam wd", 1e-3, 0.9, 0.999, 1e-8, 0.1},
      {"adam amsgrad", 1e-3, 0.9, 0.999, 1e-8, 0, true},
      {"adam maximize", 1e-2, 0.8, 0.99, 1e-6, 0, false, true},
      {"adam amsgrad wd maximize", 1e-2, 0.9, 0.999, 1e-8, 0.05, true, true},
      {"adamw", 1e-3, 0.9, 0.999, 1e-8, 1e-2, false, false, true},
      {"adamw amsgrad", 1e-2, 0.9, 0.999, 1e-8, 0.1, true, false, true},
      {"adamw maximize", 1e-3, 0.9, 0.999, 1e-8, 1e-2, false, true, true}};
  for (const auto& c : cases)
    for (bool consolidated : {false, true}) {
      const double worst = run_adam_case(c, at::kFloat, consolidated);
      std::cout << c.name << (consolidated ? " (consolidated)" : " (per leaf)")
                << ": worst |ours - torch::optim| = " << worst << " of the bound\n";
    }
  g_u = std::ldexp(1.0, -53);
  run_adam_case({"adam float64 amsgrad wd", 1e-3, 0.9, 0.999, 1e-8, 0.1, true}, at::kDouble, true);
  g_u = std::ldexp(1.0, -24);
}

TEST_P(OptimKernels, SgdAgreesWithTorchOptimToTheDerivedBound) {
  const std::vector<SgdCase> cases = {{"sgd"},
                                      {"sgd momentum", 0.1, 0.9},
                                      {"sgd dampening", 0.05, 0.9, 0.1},
                                      {"sgd nesterov", 0.1, 0.9, 0, 0, true},
                                      {"sgd wd momentum", 0.1, 0.9, 0, 1e-2},
                                      {"sgd maximize", 0.1, 0.9, 0, 1e-2, false, true}};
  for (const auto& c : cases)
    for (bool consolidated : {false, true}) {
      TreeTensor p = params_tree(at::kFloat);
      const auto grads = grads_trees(p, 10);
      std::vector<at::Tensor> theirs = torch_params(p);
      torch::optim::SGD opt(theirs, torch::optim::SGDOptions(c.lr)
                                        .momentum(c.momentum)
                                        .dampening(c.dampening)
                                        .weight_decay(c.wd)
                                        .nesterov(c.nesterov));
      TreeTensor buf = tt::zeros_like(p);
      if (consolidated) {
        p = tt::consolidate(p);
        buf = tt::consolidate(buf);
      }
      std::vector<Tracked> rp, rb;
      for (double x : flat_values(p)) rp.push_back({x, 0});
      rb.resize(rp.size());
      const auto o = tt::SgdOptions(c.lr)
                         .momentum(c.momentum)
                         .dampening(c.dampening)
                         .weight_decay(c.wd)
                         .nesterov(c.nesterov)
                         .maximize(c.maximize);
      for (int s = 1; s <= 10; ++s) {
        tt::sgd_step_single_pass(p, consolidated ? tt::consolidate(grads[s - 1]) : grads[s - 1],
                                 buf, s, o);
        set_grads(theirs, grads[s - 1], c.maximize);
        opt.step();
        const auto g = flat_values(grads[s - 1]);
        for (std::size_t i = 0; i < rp.size(); ++i) {
          Tracked d{c.maximize ? -g[i] : g[i], 0};
          if (c.wd != 0) d = add(d, scale(rp[i], f(c.wd)));
          if (c.momentum != 0) {
            rb[i] = s == 1 ? d : add(scale(rb[i], f(c.momentum)), scale(d, f(1 - c.dampening)));
            d = c.nesterov ? add(d, scale(rb[i], f(c.momentum))) : rb[i];
          }
          rp[i] = add(rp[i], scale(d, f(-c.lr)));
        }
      }
      std::vector<double> torch_values;
      for (const auto& x : theirs)
        for (double y : flat_values(TreeTensor(x.detach()))) torch_values.push_back(y);
      const double worst = check_against(flat_values(p), torch_values, rp, c.name);
      std::cout << c.name << (consolidated ? " (consolidated)" : " (per leaf)") << ": worst "
                << worst << " of the bound\n";
    }
}

// The same kernel per leaf and over consolidated buffers, under every strategy: bitwise.
TEST_P(OptimKernels, PerLeafAndConsolidatedPathsAreBitwiseEqual) {
  TreeTensor p1 = params_tree(at::kFloat), p2 = tt::consolidate(p1.clone());
  TreeTensor m1 = tt::zeros_like(p1), v1 = tt::zeros_like(p1), x1 = tt::zeros_like(p1);
  TreeTensor m2 = tt::consolidate(tt::zeros_like(p1)), v2 = tt::consolidate(tt::zeros_like(p1)),
             x2 = tt::consolidate(tt::zeros_like(p1));
  const auto grads = grads_trees(p1, 5);
  const auto o = tt::AdamOptions().lr(1e-2).weight_decay(0.1).amsgrad(true);
  for (int s = 1; s <= 5; ++s) {
    tt::adam_step_single_pass(p1, grads[s - 1], m1, v1, s, o, &x1);
    tt::adam_step_single_pass(p2, tt::consolidate(grads[s - 1]), m2, v2, s, o, &x2);
  }
  ASSERT_TRUE(tt::is_consolidated(p2)) << "updated in place: still one buffer";
  expect_same(p2, p1);
  expect_same(x2, x1);
  // A non-contiguous leaf takes the at:: path: the other leaves are the kernel's bits, that one
  // agrees with the kernel's step to the Adam step's rounding bound.
  TreeTensor q = params_tree(at::kFloat), r = params_tree(at::kFloat);
  const at::Tensor before = q.at("e.w").leaf().clone();
  q.at("e.w").leaf() = q.at("e.w").leaf().t().contiguous().t();
  ASSERT_FALSE(q.at("e.w").leaf().is_contiguous());
  TreeTensor qm = tt::zeros_like(p1), qv = tt::zeros_like(p1), rm = tt::zeros_like(p1),
             rv = tt::zeros_like(p1);
  tt::adam_step_single_pass(q, grads[0], qm, qv, 1, tt::AdamOptions());
  tt::adam_step_single_pass(r, grads[0], rm, rv, 1, tt::AdamOptions());
  for (const char* key : {"a", "b", "c", "d"}) expect_same(q.at(key), r.at(key));
  const tt::rounding::AdamStepInputs in{before,
                                        grads[0].at("e.w").leaf(),
                                        at::zeros_like(before),
                                        at::zeros_like(before),
                                        1e-3,
                                        0.9,
                                        0.999,
                                        1e-8,
                                        0,
                                        1};
  const auto agreement = tt::rounding::compare_within(q.at("e.w").leaf(), r.at("e.w").leaf(),
                                                      tt::rounding::adam_step_bound(in));
  EXPECT_TRUE(agreement.holds()) << agreement.describe();
}

TEST_P(OptimKernels, ErrorsAreClear) {
  TreeTensor p = params_tree(at::kFloat), m = tt::zeros_like(p), v = tt::zeros_like(p);
  const auto g = grads_trees(p, 1)[0];
  EXPECT_THROW(tt::adam_step_single_pass(p, g, m, v, 1, tt::AdamOptions().amsgrad(true)),
               std::invalid_argument);
  EXPECT_THROW(tt::adam_step_single_pass(p, g, m, v, 0), std::invalid_argument);
  EXPECT_THROW(tt::sgd_step_single_pass(p, g, m, 1, tt::SgdOptions(0.1).nesterov(true)),
               std::invalid_argument);
  TreeTensor other{{"a", at::zeros({0})}};
  EXPECT_THROW(tt::adam_step_single_pass(p, other, m, v, 1), tt::tree::StructureError);
}

// In the default mode a CPU step runs on as many lanes as the caller has intra-op threads (as
// an ATen kernel would), over consolidated buffers and per leaf: the bits do not depend on
// their number. Leaves past one piece (2^18 elements), with a tail, beside small ones.
TEST(OptimKernelsThreads, IntraOpThreadCountsComputeTheSameBits) {
  const int threads_before = at::get_num_threads();
  at::manual_seed(3);
  const TreeTensor p0{
      {"big", at::randn({600001})}, {"mid", at::randn({40000, 3})}, {"small", at::randn({7})}};
  const auto grads = grads_trees(p0, 3);
  auto buffer = [](const TreeTensor& t) { return tt::consolidate(t.clone()); };
  auto run = [&](int threads) {
    at::set_num_threads(threads);
    TreeTensor p = buffer(p0), m = buffer(p0 * 0), v = buffer(p0 * 0), x = buffer(p0 * 0),
               q = buffer(p0), b = buffer(p0 * 0);
    TreeTensor r = p0.clone(), rm = tt::zeros_like(p0), rv = tt::zeros_like(p0);  // per leaf
    const auto adam = tt::AdamOptions().lr(1e-2).weight_decay(0.1).amsgrad(true);
    const auto plain = tt::AdamOptions().lr(1e-2).weight_decay(0.1);
    const auto sgd = tt::SgdOptions(0.1).momentum(0.9).nesterov(true).weight_decay(0.01);
    for (int s = 1; s <= 3; ++s) {
      const TreeTensor g = buffer(grads[s - 1]);
      tt::adam_step_single_pass(p, g, m, v, s, adam, &x);
      tt::sgd_step_single_pass(q, g, b, s, sgd);
      tt::adam_step_single_pass(r, grads[s - 1], rm, rv, s, plain);
    }
    EXPECT_TRUE(tt::is_consolidated(p) && tt::is_consolidated(q) && !tt::is_consolidated(r));
    return std::vector<TreeTensor>{p, m, v, x, q, b, r, rm, rv};
  };
  const auto one = run(1), four = run(4);
  at::set_num_threads(threads_before);
  for (std::size_t k = 0; k < one.size(); ++k) expect_same(four[k], one[k]);
}

INSTANTIATE_TEST_SUITE_P(Strategies, OptimKernels, ::testing::ValuesIn(strategies()),
                         strategy_name);

// The portable and the AVX2 builds of the kernels (chosen at run time as ATen chooses its own)
// compute the same bits: every operation rounds separately in both (no FMA contraction).
namespace {
namespace d = treetensor::detail;

struct Build {
  decltype(&d::isa_default::adam_kernel) adam;
  decltype(&d::isa_default::sgd_kernel) sgd;
};
const Build kPortable{d::isa_default::adam_kernel, d::isa_default::sgd_kernel};
const Build kAvx2{d::isa_avx2::adam_kernel, d::isa_avx2::sgd_kernel};

d::OptimDtype optim_dtype(at::ScalarType t) {
  return t == at::kFloat    ? d::OptimDtype::f32
         : t == at::kDouble ? d::OptimDtype::f64
         : t == at::kHalf   ? d::OptimDtype::f16
                            : d::OptimDtype::bf16;
}

// One Adam (amsgrad, maximize, coupled decay) and one SGD (nesterov) step of `build` on
// copies of the same state: p, m, v, vmax, then p, momentum buffer; last the p both began from.
std::vector<at::Tensor> one_step(const Build& build, at::ScalarType dtype) {
  at::manual_seed(5);
  const int64_t n = 1029;  // a vector body and a tail at every width
  const at::Tensor p = at::randn({n}).to(dtype), g = (at::randn({n}) * 0.1).to(dtype),
                   m = (at::randn({n}) * 1e-2).to(dtype), v = (at::rand({n}) * 1e-3).to(dtype),
                   x = (at::rand({n}) * 1e-3).to(dtype);
  const d::AdamScalars s{0.9,
                         0.999,
                         1e-8,
                         0.01,
                         1e-3 / (1 - 0.9 * 0.9),
                         std::sqrt(1 - 0.999 * 0.999),
                         1 - 1e-3 * 0.01,
                         false,
                         true,
                         true};
  std::vector<at::Tensor> out{p.clone(), m.clone(), v.clone(), x.clone(), p.clone(), m.clone()};
  build.adam(optim_dtype(dtype),
             {out[0].data_ptr(), g.const_data_ptr(), out[1].data_ptr(), out[2].data_ptr(),
              out[3].data_ptr()},
             s, 0, n);
  const d::SgdScalars sgd{0.1, 0.9, 0.0, 1e-4, true, false, false};
  build.sgd(optim_dtype(dtype), {out[4].data_ptr(), g.const_data_ptr(), out[5].data_ptr()}, sgd, 0,
            n);
  out.push_back(p);
  return out;
}
}  // namespace

TEST(OptimKernelsIsa, PortableAndAvx2BuildsComputeTheSameBits) {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
    GTEST_SKIP() << "no AVX2 on this CPU";
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    const auto want = one_step(kPortable, dtype), got = one_step(kAvx2, dtype);
    EXPECT_FALSE(want[0].equal(want.back()) || want[4].equal(want.back()));  // real steps
    for (std::size_t k = 0; k < want.size(); ++k)
      EXPECT_TRUE(treetensor::rounding::compare_bitwise(got[k], want[k]).bitwise)
          << c10::toString(dtype) << " tensor " << k;
  }
}
