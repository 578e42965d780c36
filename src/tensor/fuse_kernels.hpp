#pragma once
// The one-pass form of a fused chain (fuse.hpp, DESIGN.md §19): where every step of a recorded
// program is one of the ops below and every tree operand is one float32 or float64 dtype, the
// chain runs per block of a few KiB — each step over the block before the next, temporaries in
// L1 — with at::vec::Vectorized's arithmetic, the very operations of ATen's own CPU kernels for
// these ops. No ATen call, tensor or allocation is made per block. The same kernels run single
// ops on leaves for the tree calls (direct_*, below).
//
// Values: +, -, *, /, reciprocal, square, neg, abs, relu, maximum, minimum are IEEE operations
// (no FMA contraction: -ffp-contract=off), so bitwise those of ATen's kernels but for NaN
// payloads, which torch does not promise and ATen itself gives differently in a tensor's
// vector body and its scalar tail (maximum's all-ones NaN there, quiet_NaN here; add's FMA
// picks another NaN operand); sqrt here is the IEEE square root but ATen's float sqrt is not
// (on this AVX-512 EPYC 198 of 1025 float32 roots differ from the correctly rounded one), and
// exp, log, tanh and sigmoid use Vectorized's (SLEEF's 1-ulp functions on x86), built for the
// instruction set ATen's kernels run with here: these are within flat execution's libm bound. The
// integer dtypes take only the wrapping ops (add, sub, mul, maximum, minimum, neg, abs, square,
// relu); the kernels do not check that: callers do.

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

/// At most this many slots (arguments, temporaries and the result) in a program.
constexpr std::int32_t kMaxVectorSlots = 64;
/// Bytes of one block of one slot: a chain's temporaries stay in L1.
constexpr std::int64_t kVectorBlockBytes = std::int64_t{8} << 10;

/// Slots [0, inputs) are the arguments, read only; the others are temporaries, except `root`,
/// which is the result.
struct VectorProgram {
  std::int32_t inputs = 0;
  std::int32_t slots = 0;
  std::int32_t root = 0;
  c10::SmallVector<VectorStep, 8> steps;  // no allocation for the usual chain
};

/// `number` as an operand of `op`, or nothing where the kernels would not give ATen's result: a
/// complex or symbolic number (ATen promotes to complex), or a bool in a subtraction (ATen's
/// error, which the caller must then let ATen raise).
std::optional<VectorOperand> vector_number(VectorOp op, const c10::Scalar& number);

/// Whether an add/sub alpha is one the kernels take: 1 (an int or a double; ATen's add computes
/// a + alpha*b with an FMA on AVX2/AVX-512 and without on the portable build, and a bool alpha
/// is its error).
bool vector_alpha(const c10::Scalar& alpha);

/// Whether every tensor operand of a one-pass kernel is one ATen would compute as a plain CPU
/// tensor: defined, strided, contiguous, on the CPU, with only the plain CPU dispatch keys (no
/// Python subclass, functorch wrapper, neg or conj view), no names, not a wrapped number, and
/// nothing for autograd to record (grad mode off or no grad required). Dtypes are checked
/// apart.
bool plain_cpu_operand(const at::Tensor& t);
/// Whether this thread forces no dispatch key beyond c10's defaults (no Python dispatch mode,
/// no functorch transform): ATen calls would then reach the CPU kernels directly.
bool plain_cpu_thread();

/// Runs `p` over elements [begin, end) of the contiguous tensors `in` (one per argument slot,
/// all of `out`'s dtype: float32, float64, int64 or int32) into `out`, in blocks of `block`
/// elements (a multiple of 64), with the build of the kernels for ATen's instruction set
/// (at::get_cpu_capability()). Thread-safe; each calling thread keeps its own block-sized
/// temporaries. @throws c10::Error (internal assert) for another dtype or a dtype mismatch.
void run_vector_program(const VectorProgram& p, c10::ArrayRef<at::Tensor> in, const at::Tensor& out,
                        std::int64_t block, std::int64_t begin, std::int64_t end);

/// The dtypes of the kernel ABI below.
enum class VectorDtype : std::uint8_t { f32, f64, i64, i32 };

/// The kernel itself, once per instruction set (namespaces isa_default, isa_avx2, isa_avx512 of
/// treetensor::detail; fuse_kernels_isa.cpp): raw pointers only, so that its file instantiates
/// no inline code of other libraries. `scratch` holds (slots - inputs) blocks of the dtype.
#define TREETENSOR_DECLARE_VECTOR_KERNEL(isa)                                              \
  namespace isa {                                                                          \
  void run_vector_kernel(const VectorProgram& p, VectorDtype dtype, const void* const* in, \
                         void* out, void* scratch, std::int64_t block, std::int64_t begin, \
                         std::int64_t end);                                                \
  }
TREETENSOR_DECLARE_VECTOR_KERNEL(isa_default)
TREETENSOR_DECLARE_VECTOR_KERNEL(isa_avx2)
TREETENSOR_DECLARE_VECTOR_KERNEL(isa_avx512)
#undef TREETENSOR_DECLARE_VECTOR_KERNEL

}  // namespace treetensor::detail

namespace treetensor::detail {

/// One elementwise op on one leaf through the one-pass kernel instead of ATen's dispatcher
/// (which costs about 0.6 us a call here, 1.9 us with a number operand, against 0.2 us for the
/// result's at::empty), where that computes what ATen's op computes and returns (NaN payloads
/// aside, above): add, sub, mul, div, maximum, minimum, neg, abs, reciprocal, square, relu on
/// float32 or float64 leaves (not sqrt, nor the libm ones, whose last elements ATen computes
/// with scalar code), and the wrapping integer ones (not div or reciprocal, which give floats) on
/// int64 or int32 leaves with int or bool numbers; on plain_cpu_operand() tensors of one dtype
/// and shape (or a number as the second) on a plain_cpu_thread(), and only for leaves ATen
/// would run on one thread (at most at::internal::GRAIN_SIZE elements, or one intra-op thread
/// as in a lane): a bigger leaf keeps ATen's intra-op parallelism. Returns an undefined
/// tensor where any of that does not hold; the caller then calls ATen. Profilers see no aten::
/// op for a leaf computed here.
/// The op of a table op's name that direct_*() may take (vector_op() less sqrt and the libm
/// ones), looked up once per tree call so that no leaf of another op pays for a check.
std::optional<VectorOp> direct_op(std::string_view name);
at::Tensor direct_unary(VectorOp op, const at::Tensor& a);
at::Tensor direct_binary(VectorOp op, const at::Tensor& a, const at::Tensor& b);
at::Tensor direct_binary(VectorOp op, const at::Tensor& a, const at::Scalar& b);

}  // namespace treetensor::detail
