// The one-pass chain kernels (fuse_kernels.hpp: run_vector_kernel), compiled once per instruction
// set as the optimizer kernels are, plus AVX-512 (TREETENSOR_ISA names the namespace;
// CMakeLists.txt; fuse.cpp picks the one matching at::get_cpu_capability()). Each op is written as
// ATen's CPU kernel writes its vector body, so both compute the same operations. Only the kernel
// ABI (fuse_kernels.hpp) and at::vec, whose code sits in a namespace per instruction set, are used
// here: an inline function of another library (std::vector, at::Tensor) instantiated here would be
// compiled with this file's -m flags, and the linker could keep that copy for the whole program.
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>

#include "tensor/fuse_kernels.hpp"

namespace treetensor::detail::TREETENSOR_ISA {
namespace {

template <class T>
using V = at::vec::Vectorized<T>;

// Integer tensors take the wrapping integer ops only (direct_ops.cpp): the floating ones are
// not instantiated for them.
template <class T>
V<T> unary(VectorOp op, const V<T>& a) {
  switch (op) {
    case VectorOp::neg:
      return a.neg();
    case VectorOp::abs:
      return a.abs();
    case VectorOp::square:
      return a * a;  // ATen's pow(x, 2)
    case VectorOp::relu:
      return at::vec::clamp_min(a, V<T>(T(0)));  // ATen's clamp_min(x, 0)
    default:
      break;
  }
  if constexpr (std::is_floating_point_v<T>) {
    switch (op) {
      case VectorOp::sqrt:
        return a.sqrt();
      case VectorOp::reciprocal:
        return a.reciprocal();
      case VectorOp::exp:
        return a.exp();
      case VectorOp::log:
        return a.log();
      case VectorOp::tanh:
        return a.tanh();
      case VectorOp::sigmoid:  // ATen's sigmoid kernel: 1 / (1 + exp(0 - x))
        return ((V<T>(T(0)) - a).exp() + V<T>(T(1))).reciprocal();
      default:
        break;
    }
  }
  return a;
}

template <class T>
V<T> binary(VectorOp op, const V<T>& a, const V<T>& b) {
  switch (op) {
    case VectorOp::add:
      return a + b;
    case VectorOp::sub:
      return a - b;
    case VectorOp::mul:
      return a * b;
    case VectorOp::maximum:
      return at::vec::maximum(a, b);
    case VectorOp::minimum:
      return at::vec::minimum(a, b);
    default:
      break;
  }
  if constexpr (std::is_floating_point_v<T>)
    if (op == VectorOp::div) return a / b;
  return a;
}

template <class T>
T number(const VectorOperand& o) {
  if constexpr (std::is_same_v<T, float>)
    return o.f;
  else if constexpr (std::is_same_v<T, double>)
    return o.d;
  else
    return static_cast<T>(o.i);  // int64 to int32 wraps, as ATen's cast of a wrapped number
}

bool is_unary(VectorOp op) {
  return op >= VectorOp::neg;
}

// One operand over one block: a pointer, or a number broadcast to a vector.
template <class T>
struct Source {
  const T* p = nullptr;
  T s{};
  V<T> load(int64_t i, int64_t count) const {
    if (!p) return V<T>(s);
    return count == V<T>::size() ? V<T>::loadu(p + i) : V<T>::loadu(p + i, count);
  }
};

template <class T>
void store(const V<T>& v, T* d, int64_t i, int64_t count) {
  if (count == V<T>::size())
    v.store(d + i);
  else
    v.store(d + i, count);
}

// The step over n elements. The op's switch sits inside the vector loop but is the same for
// every iteration, so the branch predictor resolves it; the block stays in L1.
template <class T, class F>
void for_vectors(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + V<T>::size() <= n; i += V<T>::size()) f(i, V<T>::size());
  if (i < n) f(i, n - i);
}

template <class T, VectorOp Op>
void run_step_as(const Source<T>& a, const Source<T>& b, T* d, int64_t n) {
  if constexpr (Op >= VectorOp::neg) {
    for_vectors<T>(n, [&](int64_t i, int64_t c) { store(unary<T>(Op, a.load(i, c)), d, i, c); });
  } else {
    for_vectors<T>(n, [&](int64_t i, int64_t c) {
      store(binary<T>(Op, a.load(i, c), b.load(i, c)), d, i, c);
    });
  }
}

// Each op gets its own loop (the switch above folds away in each instantiation).
template <class T>
void run_step(VectorOp op, const Source<T>& a, const Source<T>& b, T* d, int64_t n) {
  switch (op) {
#define TREETENSOR_VECTOR_CASE(name) \
  case VectorOp::name:               \
    return run_step_as<T, VectorOp::name>(a, b, d, n);
    TREETENSOR_VECTOR_CASE(add)
    TREETENSOR_VECTOR_CASE(sub)
    TREETENSOR_VECTOR_CASE(mul)
    TREETENSOR_VECTOR_CASE(div)
    TREETENSOR_VECTOR_CASE(maximum)
    TREETENSOR_VECTOR_CASE(minimum)
    TREETENSOR_VECTOR_CASE(neg)
    TREETENSOR_VECTOR_CASE(abs)
    TREETENSOR_VECTOR_CASE(sqrt)
    TREETENSOR_VECTOR_CASE(reciprocal)
    TREETENSOR_VECTOR_CASE(square)
    TREETENSOR_VECTOR_CASE(relu)
    TREETENSOR_VECTOR_CASE(exp)
    TREETENSOR_VECTOR_CASE(log)
    TREETENSOR_VECTOR_CASE(tanh)
    TREETENSOR_VECTOR_CASE(sigmoid)
#undef TREETENSOR_VECTOR_CASE
  }
}

template <class T>
void run_typed(const VectorProgram& p, const void* const* in, void* out, void* scratch,
               int64_t block, int64_t begin, int64_t end) {
  T* slot[kMaxVectorSlots];
  T* const result = static_cast<T*>(out);
  T* const temporaries = static_cast<T*>(scratch);
  for (int64_t lo = begin; lo < end; lo += block) {
    const int64_t n = std::min(block, end - lo);
    for (int32_t s = 0; s < p.slots; ++s)
      slot[s] = s < p.inputs  ? const_cast<T*>(static_cast<const T*>(in[s])) + lo
                : s == p.root ? result + lo
                              : temporaries + (s - p.inputs) * block;
    for (const VectorStep& st : p.steps) {
      Source<T> a, b;
      if (st.a.slot >= 0)
        a.p = slot[st.a.slot];
      else
        a.s = number<T>(st.a);
      if (st.b.slot >= 0 && !is_unary(st.op))
        b.p = slot[st.b.slot];
      else
        b.s = number<T>(st.b);
      run_step<T>(st.op, a, b, slot[st.dst], n);
    }
  }
}

}  // namespace

void run_vector_kernel(const VectorProgram& p, VectorDtype dtype, const void* const* in, void* out,
                       void* scratch, int64_t block, int64_t begin, int64_t end) {
  switch (dtype) {
    case VectorDtype::f32:
      return run_typed<float>(p, in, out, scratch, block, begin, end);
    case VectorDtype::f64:
      return run_typed<double>(p, in, out, scratch, block, begin, end);
    case VectorDtype::i64:
      return run_typed<int64_t>(p, in, out, scratch, block, begin, end);
    case VectorDtype::i32:
      return run_typed<int32_t>(p, in, out, scratch, block, begin, end);
  }
}

}  // namespace treetensor::detail::TREETENSOR_ISA
