// The shared "same up to rounding" verifier (DESIGN.md §5); the bound's derivation is in the
// header.
#include "treetensor/tensor/rounding.hpp"

#include <ATen/ATen.h>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace treetensor::rounding {
namespace {

void require_floating(const char* what, c10::ScalarType dtype) {
  if (!at::isFloatingType(dtype))
    throw std::invalid_argument(std::string(what) + ": needs a floating dtype, got " +
                                c10::toString(dtype));
}

double denorm_min(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kDouble:
      return std::numeric_limits<double>::denorm_min();
    case c10::kHalf:
      return std::ldexp(1.0, -24);
    case c10::kBFloat16:
      return std::ldexp(1.0, -133);
    default:
      return std::numeric_limits<float>::denorm_min();
  }
}

bool same_bits(const at::Tensor& got, const at::Tensor& ref) {
  const at::Tensor g = got.contiguous().cpu(), r = ref.contiguous().cpu();
  return std::memcmp(g.data_ptr(), r.data_ptr(), g.nbytes()) == 0;
}

}  // namespace

double unit_roundoff(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
      return std::ldexp(1.0, -24);
    case c10::kDouble:
      return std::ldexp(1.0, -53);
    case c10::kHalf:
      return std::ldexp(1.0, -11);
    case c10::kBFloat16:
      return std::ldexp(1.0, -8);
    default:
      throw std::invalid_argument(std::string("unit_roundoff: needs float32, float64, float16 or "
                                              "bfloat16, got ") +
                                  c10::toString(dtype));
  }
}

c10::ScalarType accumulate_type(c10::ScalarType dtype) {
  return dtype == c10::kHalf || dtype == c10::kBFloat16 ? c10::kFloat : dtype;
}

double gamma(std::int64_t n, c10::ScalarType dtype) {
  const double nu = double(n) * unit_roundoff(dtype);
  if (n < 0 || nu >= 1)
    throw std::invalid_argument("gamma: n = " + std::to_string(n) +
                                " terms: n·u must be in [0, 1) for a rounding bound (u = " +
                                c10::str(unit_roundoff(dtype)) + ")");
  return nu / (1 - nu);
}

std::string Agreement::describe() const {
  if (!mismatch.empty()) return mismatch;
  if (bitwise) return "bitwise equal";
  std::ostringstream os;
  os << std::setprecision(3) << worst_ratio;
  if (holds()) return os.str() + " of the rounding bound";
  return os.str() + " times the rounding bound at element " + std::to_string(worst_index);
}

Agreement compare_bitwise(const at::Tensor& got, const at::Tensor& ref) {
  Agreement a = compare_within(got, ref, at::zeros({}, at::kDouble));
  // Values that compare equal with other bits (-0 and +0, NaN payloads) still fail.
  if (!a.bitwise && a.mismatch.empty() && a.worst_ratio == 0)
    a.worst_ratio = std::numeric_limits<double>::infinity();
  return a;
}

Agreement compare_within(const at::Tensor& got, const at::Tensor& ref, const at::Tensor& bound) {
  Agreement a;
  if (!got.sizes().equals(ref.sizes()) || got.scalar_type() != ref.scalar_type()) {
    a.mismatch = c10::str("got ", got.scalar_type(), " ", got.sizes(), ", expected ",
                          ref.scalar_type(), " ", ref.sizes());
    return a;
  }
  if (same_bits(got, ref)) {
    a.bitwise = true;
    return a;
  }
  const at::Tensor g = got.to(at::kDouble), r = ref.to(at::kDouble);
  const at::Tensor diff = (g - r).abs();
  at::Tensor ratio = diff / bound.to(diff.device(), at::kDouble);
  // Equal values (also both NaN, or both the same infinity) are 0 whatever the bound; any
  // other NaN, e.g. a difference over a zero bound, is infinitely far out.
  const at::Tensor equal = (g == r) | (g.isnan() & r.isnan());
  ratio = at::where(equal, at::zeros_like(ratio), ratio);
  ratio = at::where(ratio.isnan(), std::numeric_limits<double>::infinity(), ratio);
  const at::Tensor flat = ratio.reshape({-1});
  a.worst_index = flat.argmax().item<std::int64_t>();
  a.worst_ratio = flat[a.worst_index].item<double>();
  return a;
}

at::Tensor matmul_bound(const at::Tensor& a, const at::Tensor& b, c10::ScalarType out) {
  require_floating("matmul_bound", a.scalar_type());
  require_floating("matmul_bound", b.scalar_type());
  require_floating("matmul_bound", out);
  const std::int64_t k = a.size(-1);
  const double relative = 2 * (gamma(k, accumulate_type(out)) + unit_roundoff(out));
  const double underflow = 4.0 * double(k) * denorm_min(out);
  return at::matmul(a.to(at::kDouble).abs(), b.to(at::kDouble).abs()) * relative + underflow;
}

at::Tensor adam_step_bound(const AdamStepInputs& in) {
  const c10::ScalarType dtype = in.param.scalar_type();
  require_floating("adam_step_bound", dtype);
  const double u = unit_roundoff(accumulate_type(dtype));
  // Scalars as the kernels see them (cast to the compute type), values in float64.
  auto c = [&](double x) {
    return at::scalar_tensor(x, at::kDouble).to(accumulate_type(dtype)).item<double>();
  };
  auto d = [](const at::Tensor& t) { return t.detach().to(at::kDouble); };
  struct T {
    at::Tensor v, e;
  };
  auto round = [&](at::Tensor v, at::Tensor e) { return T{v, e + u * v.abs()}; };
  auto scale = [&](const T& a, double k) { return round(a.v * k, std::abs(k) * a.e); };
  auto add = [&](const T& a, const T& b) { return round(a.v + b.v, a.e + b.e); };
  auto mul = [&](const T& a, const T& b) {
    return round(a.v * b.v, a.v.abs() * b.e + b.v.abs() * a.e + a.e * b.e);
  };
  auto div = [&](const T& a, const T& b) {
    const at::Tensor z = a.v / b.v;
    return round(z, (a.e + z.abs() * b.e) / (b.v.abs() - b.e));
  };
  auto root = [&](const T& a) {
    const at::Tensor z = a.v.sqrt();
    return round(z, a.e / (z + (a.v - a.e).clamp_min(0).sqrt()));
  };
  auto exact = [](const at::Tensor& v) { return T{v, at::zeros_like(v)}; };
  const double t = double(in.step);
  const double bc1 = 1 - std::pow(in.beta1, t), bc2_sqrt = std::sqrt(1 - std::pow(in.beta2, t));
  const T p = exact(d(in.param)), m0 = exact(d(in.exp_avg)), v0 = exact(d(in.exp_avg_sq));
  T g = exact(d(in.grad));
  if (in.weight_decay != 0) g = add(g, scale(p, c(in.weight_decay)));
  const T m = add(scale(m0, c(in.beta1)), scale(g, c(1 - in.beta1)));
  const T v = add(scale(v0, c(in.beta2)), mul(scale(g, c(1 - in.beta2)), g));
  const at::Tensor bc2 = at::full_like(v.v, c(bc2_sqrt)), eps = at::full_like(v.v, c(in.eps));
  const T denom = add(div(root(v), exact(bc2)), exact(eps));
  const T out = add(p, div(scale(m, c(-in.lr / bc1)), denom));
  return 2.02 * out.e;
}

Agreement compare_matmul(const at::Tensor& got, const at::Tensor& ref, const at::Tensor& a,
                         const at::Tensor& b) {
  const at::Tensor bound = matmul_bound(a, b, got.scalar_type());
  if (!bound.sizes().equals(got.sizes()))
    throw std::invalid_argument(
        c10::str("compare_matmul: the result is ", got.sizes(), ", matmul gives ", bound.sizes()));
  return compare_within(got, ref, bound);
}

}  // namespace treetensor::rounding
