// Single-pass Adam/AdamW/SGD kernels (optim_kernels.hpp; DESIGN.md §12), compiled once per
// instruction set: TREETENSOR_ISA names the namespace (default, avx2), and for avx2 the build
// defines CPU_CAPABILITY_AVX2 so that at::vec::Vectorized uses 256-bit registers, as ATen's own
// per-capability kernels do. Every operation is a separate IEEE multiply, add, divide or
// square root (no FMA, no contraction), so both builds compute the same bits; only the speed
// differs. optim_kernels.cpp picks one at run time. Only the kernel ABI (raw pointers), at::vec,
// whose code sits in a namespace per instruction set, and c10's float16/bfloat16 conversions
// are used here.
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>

#include "tensor/optim_kernels.hpp"

namespace treetensor::detail::TREETENSOR_ISA {
namespace {

// The few operations that differ between a lane of Vectorized<C> and a scalar C.
template <class C>
C neg(C x) {
  return -x;
}
template <class C>
at::vec::Vectorized<C> neg(const at::vec::Vectorized<C>& x) {
  return x.neg();
}
template <class C>
C root(C x) {
  return std::sqrt(x);
}
template <class C>
at::vec::Vectorized<C> root(const at::vec::Vectorized<C>& x) {
  return x.sqrt();
}
// torch.maximum: NaN wins.
template <class C>
C nan_max(C a, C b) {
  return a != a ? a : (b != b ? b : (a > b ? a : b));
}
template <class C>
at::vec::Vectorized<C> nan_max(const at::vec::Vectorized<C>& a, const at::vec::Vectorized<C>& b) {
  return at::vec::maximum(a, b);
}

// One element (or one vector of them) of an Adam step, in torch.optim.Adam's operation order:
// grad.add(p, wd); m.mul_(b1).add_(g, 1-b1); v.mul_(b2).addcmul_(g, g, 1-b2);
// denom = sqrt(v or max(vmax, v)) / bias2_sqrt + eps; p.addcdiv_(m, denom, -step_size).
template <class C>
struct AdamMath {
  C b1, c1, b2, c2, wd, neg_step, bias2_sqrt, eps, decay;
  bool decoupled, amsgrad, maximize;

  explicit AdamMath(const AdamScalars& s)
      : b1(C(s.beta1)),
        c1(C(1 - s.beta1)),
        b2(C(s.beta2)),
        c2(C(1 - s.beta2)),
        wd(C(s.weight_decay)),
        neg_step(C(-s.step_size)),
        bias2_sqrt(C(s.bias2_sqrt)),
        eps(C(s.eps)),
        decay(C(s.decay_factor)),
        decoupled(s.decoupled),
        amsgrad(s.amsgrad),
        maximize(s.maximize) {}

  template <class W>
  void operator()(W& p, W g, W& m, W& v, W& vmax) const {
    if (maximize) g = neg(g);
    if (!decoupled && wd != C(0)) g = g + W(wd) * p;
    if (decoupled && wd != C(0)) p = p * W(decay);
    m = m * W(b1);
    m = m + W(c1) * g;
    v = v * W(b2);
    v = v + (W(c2) * g) * g;
    W d = v;
    if (amsgrad) d = vmax = nan_max(vmax, v);
    const W denom = root(d) / W(bias2_sqrt) + W(eps);
    p = p + (W(neg_step) * m) / denom;
  }
};

// torch.optim.SGD: d = g (+ wd·p); buf = d on the first step, else buf·momentum + (1-damp)·d;
// d = nesterov ? d + momentum·buf : buf; p.add_(d, -lr).
template <class C>
struct SgdMath {
  C neg_lr, momentum, keep, wd;
  bool nesterov, maximize, first;

  explicit SgdMath(const SgdScalars& s)
      : neg_lr(C(-s.lr)),
        momentum(C(s.momentum)),
        keep(C(1 - s.dampening)),
        wd(C(s.weight_decay)),
        nesterov(s.nesterov),
        maximize(s.maximize),
        first(s.first_step) {}

  template <class W>
  void operator()(W& p, W g, W& buf, bool has_buf) const {
    if (maximize) g = neg(g);
    if (wd != C(0)) g = g + W(wd) * p;
    if (has_buf) {
      buf = first ? g : buf * W(momentum) + W(keep) * g;
      g = nesterov ? g + W(momentum) * buf : buf;
    }
    p = p + W(neg_lr) * g;
  }
};

// Runs math over [begin, end): Vectorized<C> for the body, the same math on scalars for the
// tail. For float16/bfloat16 storage (T != C) every element goes through C one at a time.
template <class T, class C, class F>
void for_elements(int64_t begin, int64_t end, F&& vector_step, auto&& scalar_step) {
  using V = at::vec::Vectorized<C>;
  int64_t i = begin;
  if constexpr (std::is_same_v<T, C>)
    for (; i + V::size() <= end; i += V::size()) vector_step(i);
  for (; i < end; ++i) scalar_step(i);
}

template <class T, class C>
void adam_typed(T* p, const T* g, T* m, T* v, T* vmax, const AdamScalars& s, int64_t begin,
                int64_t end) {
  using V = at::vec::Vectorized<C>;
  const AdamMath<C> math(s);
  auto vec = [&](int64_t i) {
    if constexpr (std::is_same_v<T, C>) {
      V P = V::loadu(p + i), M = V::loadu(m + i), W = V::loadu(v + i);
      V X = vmax ? V::loadu(vmax + i) : V(C(0));
      math(P, V::loadu(g + i), M, W, X);
      P.store(p + i);
      M.store(m + i);
      W.store(v + i);
      if (vmax) X.store(vmax + i);
    }
  };
  auto one = [&](int64_t i) {
    C P = C(p[i]), M = C(m[i]), W = C(v[i]), X = vmax ? C(vmax[i]) : C(0);
    math(P, C(g[i]), M, W, X);
    p[i] = T(P);
    m[i] = T(M);
    v[i] = T(W);
    if (vmax) vmax[i] = T(X);
  };
  for_elements<T, C>(begin, end, vec, one);
}

template <class T, class C>
void sgd_typed(T* p, const T* g, T* buf, const SgdScalars& s, int64_t begin, int64_t end) {
  using V = at::vec::Vectorized<C>;
  const SgdMath<C> math(s);
  auto vec = [&](int64_t i) {
    if constexpr (std::is_same_v<T, C>) {
      V P = V::loadu(p + i), B = buf ? V::loadu(buf + i) : V(C(0));
      math(P, V::loadu(g + i), B, buf != nullptr);
      P.store(p + i);
      if (buf) B.store(buf + i);
    }
  };
  auto one = [&](int64_t i) {
    C P = C(p[i]), B = buf ? C(buf[i]) : C(0);
    math(P, C(g[i]), B, buf != nullptr);
    p[i] = T(P);
    if (buf) buf[i] = T(B);
  };
  for_elements<T, C>(begin, end, vec, one);
}

// Calls f.template operator()<T, C>() for the storage type T and compute type C of `dtype`.
template <class F>
void by_dtype(OptimDtype dtype, F&& f) {
  switch (dtype) {
    case OptimDtype::f32:
      return f.template operator()<float, float>();
    case OptimDtype::f64:
      return f.template operator()<double, double>();
    case OptimDtype::f16:
      return f.template operator()<c10::Half, float>();
    case OptimDtype::bf16:
      return f.template operator()<c10::BFloat16, float>();
  }
}

}  // namespace

void adam_kernel(OptimDtype dtype, const AdamPointers& t, const AdamScalars& s, int64_t begin,
                 int64_t end) {
  by_dtype(dtype, [&]<class T, class C>() {
    adam_typed<T, C>(static_cast<T*>(t.p), static_cast<const T*>(t.g), static_cast<T*>(t.m),
                     static_cast<T*>(t.v), static_cast<T*>(t.vmax), s, begin, end);
  });
}

void sgd_kernel(OptimDtype dtype, const SgdPointers& t, const SgdScalars& s, int64_t begin,
                int64_t end) {
  by_dtype(dtype, [&]<class T, class C>() {
    sgd_typed<T, C>(static_cast<T*>(t.p), static_cast<const T*>(t.g), static_cast<T*>(t.buf), s,
                    begin, end);
  });
}

}  // namespace treetensor::detail::TREETENSOR_ISA
