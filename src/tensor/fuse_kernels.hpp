#pragma once
// The one-pass form of a fused chain (fuse.hpp, DESIGN.md §19): where every step of a recorded
// program is one of the ops below and every tree operand is one float32 or float64 dtype, the
// chain runs per block of a few KiB — each step over the block before the next, temporaries in
// L1 — with at::vec::Vectorized's arithmetic, the very operations of ATen's own CPU kernels for
// these ops. No ATen call, tensor or allocation is made per block.
//
// Values: +, -, *, /, sqrt, reciprocal, square, neg, abs, relu, maximum, minimum are IEEE
// operations (no FMA contraction: -ffp-contract=off), so bitwise those of ATen's kernels;
// exp, log, tanh and sigmoid use Vectorized's (SLEEF's 1-ulp functions on x86), built for
// the instruction set ATen's kernels run with here, within flat execution's libm bound.

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <optional>
#include <string_view>

namespace treetensor::detail {

enum class VectorOp : std::uint8_t {
  // binary
  add,
  sub,
  mul,
  div,
  maximum,
  minimum,
  // unary
  neg,
  abs,
  sqrt,
  reciprocal,
  square,
  relu,
  exp,
  log,
  tanh,
  sigmoid,
};

/// The op of a recorded step's name ("mul", "sigmoid_", ...), if it has a one-pass form.
std::optional<VectorOp> vector_op(std::string_view name);

/// A slot of the program, or (slot < 0) a number, already cast to each dtype as ATen casts a
/// wrapped number operand (a static_cast of its int64 or double, never a range check).
struct VectorOperand {
  std::int32_t slot = -1;
  float f = 0;
  double d = 0;
  std::int64_t i = 0;     // the number as an int64, for integer tensors
  bool integral = false;  // an int or a bool (promotes no integer tensor to floating)
};

struct VectorStep {
  VectorOp op;
  std::int32_t dst;    // a temporary slot, or the root
  VectorOperand a, b;  // b unused by unary ops
};

/// Slots [0, inputs) are the arguments, read only; the others are temporaries, except `root`,
/// which is the result.
struct VectorProgram {
  std::int32_t inputs = 0;
  std::int32_t slots = 0;
  std::int32_t root = 0;
  c10::SmallVector<VectorStep, 8> steps;  // no allocation for the usual chain
};

/// A real number as an operand, or nothing for a complex or symbolic one (ATen would promote
/// the result to complex, which the kernels do not compute).
std::optional<VectorOperand> vector_number(const c10::Scalar& s);

/// Runs `p` over elements [begin, end) of contiguous tensors `in` (one per argument slot, all
/// of `out`'s dtype: float32 or float64; int64 or int32 for the integer ops) into `out`, in blocks
/// of `block` elements (a multiple of 64). Thread-safe; each calling thread keeps its own
/// block-sized temporaries.
void run_vector_program(const VectorProgram& p, c10::ArrayRef<at::Tensor> in, const at::Tensor& out,
                        std::int64_t block, std::int64_t begin, std::int64_t end);

}  // namespace treetensor::detail

namespace treetensor::detail {

/// One elementwise op on one leaf through the one-pass kernel instead of ATen's dispatcher
/// (which costs about 0.6 us a call here, 1.9 us with a number operand, against 0.2 us for the
/// result's at::empty), where that computes exactly what ATen's op computes and returns: the
/// ops whose kernel is an IEEE operation (add, sub, mul, div, maximum, minimum, neg, abs,
/// reciprocal, square, relu; not sqrt, whose NaN sign differs, nor the libm ones, whose last
/// elements ATen computes with scalar code) on float32 or float64 leaves, and the wrapping
/// integer ones (add, sub, mul, maximum, minimum, neg, abs, square, relu: not div or
/// reciprocal, which give floats) on int64 or int32 leaves with int or bool numbers; on a
/// defined, contiguous, strided CPU tensor (both operands of one dtype and shape, or a number
/// as the second) with only the plain CPU dispatch keys, no names, nothing for autograd to
/// record (grad mode off, or no operand requiring grad) and no dispatch key forced on this
/// thread (a Python mode, functorch). Returns an undefined tensor where any of that does not
/// hold; the caller then calls ATen. Profilers see no aten:: op for a leaf computed here.
at::Tensor direct_unary(VectorOp op, const at::Tensor& a);
at::Tensor direct_binary(VectorOp op, const at::Tensor& a, const at::Tensor& b);
at::Tensor direct_binary(VectorOp op, const at::Tensor& a, const at::Scalar& b);

}  // namespace treetensor::detail
