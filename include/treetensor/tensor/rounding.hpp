#pragma once
// "The same result up to rounding": one verifier that the tests and treetensor-bench share
// (DESIGN.md §5). Elementwise ops, fixed-order reductions and optimizer steps are compared
// bitwise. A BLAS call (matmul, bmm) may run with another thread count inside a lane than on
// the caller, and OpenBLAS's blocking, hence its summation order, depends on the thread count
// (seen on the Zen kernels for 64x128 @ 128x256 float32): such results are compared against
// an error bound derived from the op, never against a guessed tolerance.
//
// The bound (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., §3.1, Lemma
// 3.1 and eq. 3.5): a dot product of K terms computed in any order, with or without FMA, has
// |fl(x·y) - x·y| <= gamma_K · (|x|·|y|), gamma_K = K·u / (1 - K·u), u the unit roundoff of the
// accumulation type. Two such computations of C = A @ B therefore differ by at most
// 2·(gamma_K(acc) + u(out))·(|A| @ |B|) elementwise; the u(out) term covers rounding the
// accumulator to a narrower output dtype (float16 / bfloat16 accumulate in float32), and two
// subnormal spacings per term cover gradual underflow.
//
// Thread safety: pure functions of their arguments.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

namespace treetensor::rounding {

/// Unit roundoff u = eps / 2 of a floating dtype: 2^-24 for float32, 2^-53 for float64,
/// 2^-11 for float16, 2^-8 for bfloat16. @throws std::invalid_argument for other dtypes.
double unit_roundoff(c10::ScalarType dtype);

/// The dtype kernels accumulate a `dtype` reduction in on the CPU and CUDA (at::acc_type):
/// float32 for float16 / bfloat16, else `dtype` itself.
c10::ScalarType accumulate_type(c10::ScalarType dtype);

/// gamma_n = n·u / (1 - n·u) for the unit roundoff of `dtype`: the relative error bound of any
/// n-term summation or dot product. @throws std::invalid_argument when n·u >= 1 (no bound).
double gamma(std::int64_t n, c10::ScalarType dtype);

/// How a result agrees with its reference.
struct Agreement {
  bool bitwise = false;           ///< same shape, dtype and bits everywhere (NaN == NaN)
  double worst_ratio = 0;         ///< max over elements of |got - ref| / bound (0 when bitwise)
  std::int64_t worst_index = -1;  ///< flat index of that element, -1 when bitwise
  std::string mismatch;           ///< non-empty when shapes or dtypes differ (then nothing holds)
  /// Whether every element is within its bound.
  bool holds() const { return mismatch.empty() && worst_ratio <= 1.0; }
  /// "bitwise equal", "0.031 of the rounding bound", "5.2 times the rounding bound at
  /// element 17", or the mismatch.
  std::string describe() const;
};

/// Bitwise comparison: holds() only when got and ref are bit-identical.
Agreement compare_bitwise(const at::Tensor& got, const at::Tensor& ref);

/// got and ref are two computations of at::matmul(a, b) (any shapes matmul takes; floating
/// dtype): checks |got - ref| <= 2·(gamma_K(acc) + u(dtype))·(|a| @ |b|) + 4·K·denorm_min
/// elementwise, K = a.size(-1) (1-D a: its length). The bound is computed in float64.
/// @throws std::invalid_argument when a and b are not floating or got's shape is not matmul's.
Agreement compare_matmul(const at::Tensor& got, const at::Tensor& ref, const at::Tensor& a,
                         const at::Tensor& b);

/// The elementwise bound of compare_matmul for results of dtype `out` (float64 tensor of
/// matmul(a, b)'s shape), for callers that compare many results against one product.
/// @throws std::invalid_argument when a, b or out is not floating.
at::Tensor matmul_bound(const at::Tensor& a, const at::Tensor& b, c10::ScalarType out);

/// Inputs and hyper-parameters of one Adam step, for adam_step_bound().
struct AdamStepInputs {
  at::Tensor param, grad, exp_avg, exp_avg_sq;  ///< the state before the step (one dtype)
  double lr, beta1, beta2, eps, weight_decay;
  std::int64_t step;  ///< 1-based
};

/// The elementwise bound on |p_a - p_b| for two computations of one Adam step (torch.optim.Adam
/// without amsgrad: weight decay added to the gradient) from the same inputs, e.g. the at:: loop
/// (whose kernels may fuse a multiply-add) and the single-pass kernel: twice the first-order
/// running error bound of one computation (Higham §3.3: each operation adds u·|result| to the
/// propagated input errors), times 1.01 for the dropped second-order terms. float64 tensor of
/// param's shape. @throws std::invalid_argument for a non-floating dtype.
at::Tensor adam_step_bound(const AdamStepInputs& in);

/// |got - ref| <= bound elementwise (bound broadcasts to got; computed in float64).
Agreement compare_within(const at::Tensor& got, const at::Tensor& ref, const at::Tensor& bound);

}  // namespace treetensor::rounding
