#pragma once
// Fused tree expressions (DESIGN.md §19): a chain of elementwise tree ops recorded once as a
// small program and run leaf-major — the whole chain on one leaf, or on one cache-sized tile of
// a leaf or of a consolidated buffer, before the next — instead of one tree-wide pass per op.
// The loop a user writes by hand (`for (k, x) : map) out[k] = (x * 2 + y[k]).sigmoid_();`)
// keeps its temporaries in L2; op-at-a-time tree calls make every temporary tree-sized.
//
// Example (one generic lambda serves tensors, trees and fuse alike):
//   auto chain = [](const auto& x, const auto& y) { return (x * 2 + y).sigmoid_(); };
//   TreeTensor r = fuse(chain, x, y);          // leaf-major; == chain(x, y) op at a time
//   at::Tensor one = chain(x_leaf, y_leaf);    // the same lambda on one pair of tensors

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "treetensor/tensor/tree_tensor.hpp"

namespace treetensor {

/// How fuse() cuts its work.
struct FuseOptions {
  /// Bytes of one tile of the widest tree operand: a leaf (or a consolidated buffer) with more
  /// elements runs the chain tile by tile, each tile a multiple of 64 elements (at least 64),
  /// so every temporary stays in cache. 64 KiB by default (the 32–256 KiB range): four
  /// operand-sized tiles of a two-input chain fit a 1 MiB L2, and a temporary stays under
  /// glibc's 128 KiB mmap threshold, so freed tiles are reused instead of page-faulted in again
  /// (measured once on 2 busy cores, 2000 x 65536 floats under stream(1): whole 256 KiB
  /// leaves per job 2460 ms, 64 KiB tiles 461 ms, medians of 7).
  std::int64_t tile_bytes = std::int64_t{64} << 10;
  /// Sets tile_bytes. @throws std::invalid_argument when bytes < 1.
  FuseOptions& tile(std::int64_t bytes);
};

namespace detail {
class FuseRecorder;
struct FuseProgram;
struct UnaryKernels;
struct BinaryKernels;
}  // namespace detail

class Expr;

/// An operand of an Expr op: another Expr of the same fuse() call, a number, or a tensor
/// (broadcast to every leaf as in a tree call; a 0-d tensor keeps tiling possible, any other
/// shape makes the chain run on whole leaves).
class ExprOperand {
 public:
  enum class Kind : std::uint8_t { expr, scalar, tensor };
  ExprOperand(const Expr& e) noexcept : expr_(&e) {}                     // NOLINT
  ExprOperand(const at::Scalar& s) : scalar_(s), kind_(Kind::scalar) {}  // NOLINT
  ExprOperand(const at::Tensor& t) : tensor_(t), kind_(Kind::tensor) {}  // NOLINT
  template <class N>
  requires std::is_arithmetic_v<N> ExprOperand(N v)  // NOLINT
      : scalar_(std::is_same_v<N, bool> ? at::Scalar(static_cast<bool>(v))
                : std::is_integral_v<N> ? at::Scalar(static_cast<int64_t>(v))
                                        : at::Scalar(static_cast<double>(v))),
        kind_(Kind::scalar) {}

 private:
  friend class detail::FuseRecorder;
  const Expr* expr_ = nullptr;
  at::Scalar scalar_;
  at::Tensor tensor_;
  Kind kind_ = Kind::expr;
};

/// A value inside the function given to fuse(): an argument, or the result of ops on
/// arguments. It has the method and operator spelling of at::Tensor for the op table's
/// elementwise ops (so a generic lambda written for tensors records a program when given
/// Exprs): unary `x.sigmoid()` / `x.sigmoid_()`, binary `x.mul(y)` / `x.mul_(y)`,
/// `x.add(y, alpha)`, operators `+ - * /` and unary `-`.
///
/// Semantics are eager torch's: ops take effect in the order they are written, and an in-place
/// op changes the value every copy of that Expr sees (copies alias one tensor, as copies of an
/// at::Tensor do). In-place ops are allowed on results of ops only.
/// @throws std::invalid_argument (when written) for an in-place op on an argument of fuse() or
///         on a broadcast tensor (fuse() writes a new tree; write `x.sigmoid()`), for detach
///         (not arithmetic), and for Exprs of two different fuse() calls in one op.
/// An Expr refers to its fuse() call's recorder: it must not outlive the function call.
class Expr {
 public:
  Expr(const Expr&) = default;
  Expr& operator=(const Expr&) = default;

  // The op registry's elementwise ops (codegen/ops.toml), generated:
#include "treetensor/tensor/fuse_ops.inc"  // NOLINT(build/include): inside the class

  /// self + alpha·other / self - alpha·other (at::add / at::sub), and in place.
  Expr add(const ExprOperand& other, const at::Scalar& alpha = 1) const;
  Expr& add_(const ExprOperand& other, const at::Scalar& alpha = 1);
  Expr sub(const ExprOperand& other, const at::Scalar& alpha = 1) const;
  Expr& sub_(const ExprOperand& other, const at::Scalar& alpha = 1);

  Expr operator-() const {
    return neg();
  }
  Expr& operator+=(const ExprOperand& o) {
    return add_(o);
  }
  Expr& operator-=(const ExprOperand& o) {
    return sub_(o);
  }
  Expr& operator*=(const ExprOperand& o) {
    return mul_(o);
  }
  Expr& operator/=(const ExprOperand& o) {
    return div_(o);
  }

 private:
  friend class detail::FuseRecorder;
  Expr(detail::FuseRecorder* r, std::uint32_t slot) noexcept : rec_(r), slot_(slot) {}
  detail::FuseRecorder* rec_;
  std::uint32_t slot_;
};

namespace detail {
template <class A>
concept ExprArg = std::same_as<std::decay_t<A>, Expr>;
template <class A, class B>
concept ExprOperatorArgs = (ExprArg<A> || ExprArg<B>)&&std::is_convertible_v<
    const A&, ExprOperand>&& std::is_convertible_v<const B&, ExprOperand>;

/// The recorded program (opaque outside src/tensor/fuse.cpp).
struct FuseProgramDeleter {
  void operator()(FuseProgram* p) const noexcept;
};
using FuseProgramPtr = std::unique_ptr<FuseProgram, FuseProgramDeleter>;

/// Records the ops applied to the Exprs of one fuse() call.
class FuseRecorder {
 public:
  explicit FuseRecorder(std::size_t inputs);
  ~FuseRecorder();
  FuseRecorder(const FuseRecorder&) = delete;
  FuseRecorder& operator=(const FuseRecorder&) = delete;
  /// The Expr of argument k.
  Expr input(std::size_t k) noexcept { return Expr(this, static_cast<std::uint32_t>(k)); }
  /// Records a unary table op (`op` names it in messages); `inplace` updates a's slot.
  Expr unary(std::string_view op, const UnaryKernels& k, const Expr& a, bool inplace);
  /// Records a binary op (a table op, or add/sub with alpha); `inplace` updates a's slot.
  Expr binary(std::string_view op, const BinaryKernels& k, const ExprOperand& a,
              const ExprOperand& b, const at::Scalar& alpha, bool inplace);
  /// Records `a <op> b` for the operators (op: add, sub, mul or div), on the recorder of
  /// whichever side is an Expr.
  static Expr operate(std::string_view op, const ExprOperand& a, const ExprOperand& b);
  /// The program whose result is `root`.
  FuseProgramPtr finish(const Expr& root);

 private:
  FuseProgramPtr p_;
};

/// Runs `program` over `args` (see fuse()).
TreeTensor run_fuse(const FuseOptions& o, const FuseProgram& program, c10::ArrayRef<Operand> args);
}  // namespace detail

/// a + b, a - b, a * b, a / b with at least one side an Expr (a number or tensor on the left
/// enters as in torch's `2 - t`: a wrapped number, or the tensor, as the first operand).
template <class A, class B>
requires detail::ExprOperatorArgs<A, B> Expr operator+(const A& a, const B& b) {
  return detail::FuseRecorder::operate("add", a, b);
}
template <class A, class B>
requires detail::ExprOperatorArgs<A, B> Expr operator-(const A& a, const B& b) {
  return detail::FuseRecorder::operate("sub", a, b);
}
template <class A, class B>
requires detail::ExprOperatorArgs<A, B> Expr operator*(const A& a, const B& b) {
  return detail::FuseRecorder::operate("mul", a, b);
}
template <class A, class B>
requires detail::ExprOperatorArgs<A, B> Expr operator/(const A& a, const B& b) {
  return detail::FuseRecorder::operate("div", a, b);
}

/// Runs `f` — a function of Exprs returning an Expr, e.g. the generic lambda
/// `[](const auto& x, const auto& y) { return (x * 2 + y).sigmoid_(); }` — leaf-major over the
/// argument trees: f is called once, with one Expr per argument, to record its ops; then, for
/// every leaf of the zipped trees, the whole chain runs on that leaf before the next leaf
/// starts. A leaf (or, on consolidated trees, a buffer) of more than one tile
/// (FuseOptions::tile_bytes) runs tile by tile, so the chain's temporaries are tile-sized.
///
/// Arguments: trees (zipped strictly, as every tree call: same keys, else tree::StructureError
/// naming the path and both key sets) and tensors (broadcast to every leaf); at least one
/// tree. Numbers belong in f (`x * 2`). Shapes and dtypes: each leaf follows torch's rules
/// exactly as `f` on that leaf's tensors would (broadcasting between a leaf's operands, type
/// promotion, mixed dtypes across arguments and across leaves); the result has the zipped
/// structure and, per leaf, the dtype and shape f gives there.
///
/// Execution: one leaf job per leaf through runtime::run(), so stream(M), automatic (which
/// times linear against lanes for the call shape), asyncs scopes (the call runs on the
/// scope's thread) and operand tracking apply as to any tree call. On consolidated trees of one
/// layout the chain runs on the buffers (flat execution, DESIGN.md §12, with its conditions and
/// its 32 MiB fresh-buffer rule); the result is then consolidated. Tiles are used where every
/// tree operand of a leaf is contiguous with one shape, every broadcast tensor is 0-d, the
/// leaf is on the CPU and no operand needs a gradient; otherwise the chain runs on whole
/// leaves.
/// Autograd: when grad mode is on and an operand requires grad, each leaf runs the chain whole
/// with ATen's own autograd, so the graph (and backward) is the op-at-a-time one's, leaf by leaf.
/// One pass: where every tree operand of a tileable leaf is float32 (or every one float64),
/// no tensor is broadcast, and every step is + - * / (alpha 1), maximum, minimum, neg, abs,
/// sqrt, reciprocal, square, relu, exp, log, tanh or sigmoid (numbers as other operands), the
/// chain runs without any ATen call: block by block (8 KiB, or less with a smaller
/// tile_bytes), with ATen's own vector arithmetic for the instruction set ATen uses here
/// (DESIGN.md §19). Other chains run as ATen calls per tile.
/// Values: bitwise those of `f` applied op at a time to the trees for correctly rounded ops
/// (add, sub, mul, div, comparisons, ...; NaN payloads aside); for sqrt in one pass (the IEEE
/// root, where ATen's float sqrt on AVX-512 is not) and libm-style functions (exp, log,
/// sigmoid, tanh, ...; ATen computes a tensor's last n mod 16 elements with the scalar form,
/// so where tiles, blocks or buffers move that tail the last bits may differ) within 8 ulp (as
/// flat execution).
/// @throws std::invalid_argument when no argument is a tree, when an argument is a number, or
///         as Expr documents; tree::StructureError as above; a torch error of a leaf with its
///         type kept and "fuse(<ops>) at leaf '<path>': <op> (step i of n): " prepended.
/// Thread safety: as a tree call; f is called once, on the calling thread.
template <class F, class... A>
requires(std::is_convertible_v<const A&, Operand>&&...) TreeTensor
    fuse(const FuseOptions& o, F&& f, const A&... args) {
  static_assert(sizeof...(A) > 0, "fuse: give at least one tree argument");
  detail::FuseRecorder rec(sizeof...(A));
  std::size_t k = 0;
  std::array<Expr, sizeof...(A)> inputs{((void)args, rec.input(k++))...};
  const Expr root = std::apply(std::forward<F>(f), inputs);
  const detail::FuseProgramPtr program = rec.finish(root);
  const Operand ops[] = {Operand(args)...};
  return detail::run_fuse(o, *program, ops);
}
template <class F, class... A>
requires(std::is_convertible_v<const A&, Operand>&&...) TreeTensor fuse(F&& f, const A&... args) {
  return fuse(FuseOptions{}, std::forward<F>(f), args...);
}

}  // namespace treetensor
