// One elementwise op on one leaf without ATen's dispatcher (fuse_kernels.hpp): a one-step
// vector program, for the per-leaf kernels of the op table's elementwise tree calls.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "tensor/fuse_kernels.hpp"

namespace treetensor::detail {
namespace {

// The keys of a plain CPU tensor (its backend, autograd and in-place-or-view keys); any other
// (Python subclasses, functorch wrappers, neg or conj views, ...) means ATen must see the call.
const c10::DispatchKeySet kPlainCpu{c10::DispatchKey::CPU, c10::DispatchKey::ADInplaceOrView,
                                    c10::DispatchKey::AutogradCPU, c10::DispatchKey::AutocastCPU};

bool floating(at::ScalarType d) {
  return d == at::kFloat || d == at::kDouble;
}

// Whether a direct_op() on `dtype` is computed as ATen computes it (fuse_kernels.hpp).
bool exact(VectorOp op, at::ScalarType dtype) {
  if (op == VectorOp::div || op == VectorOp::reciprocal)
    return floating(dtype);  // integer operands give floats
  return floating(dtype) || dtype == at::kLong || dtype == at::kInt;
}

// The strides at::empty gives: ATen's result has them for such operands (TensorIterator's
// output keeps an operand's strides where a size-1 dimension leaves them free, as in a
// transposed row or an NC11 channels-last tensor; those go to ATen).
bool canonical_strides(const at::Tensor& t) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    if (t.stride(d) != expected) return false;
    expected *= std::max<int64_t>(t.size(d), 1);
  }
  return true;
}

// A leaf ATen would compute on one thread: at most one grain, or one intra-op thread (as in a
// lane or an asyncs worker). A bigger leaf keeps ATen's intra-op parallelism.
bool one_thread(const at::Tensor& t) {
  return t.numel() <= at::internal::GRAIN_SIZE || at::get_num_threads() == 1;
}

bool ready(VectorOp op, const at::Tensor& t) {
  return plain_cpu_operand(t) && exact(op, t.scalar_type()) && canonical_strides(t) &&
         one_thread(t) && plain_cpu_thread();
}

at::Tensor run(const VectorProgram& p, c10::ArrayRef<at::Tensor> in) {
  at::Tensor out = at::empty(in[0].sizes(), in[0].options());
  run_vector_program(p, in, out, kVectorBlockBytes / static_cast<int64_t>(in[0].element_size()), 0,
                     in[0].numel());
  return out;
}

VectorProgram one_step(VectorOp op, std::int32_t inputs) {
  VectorProgram p;
  p.inputs = inputs;
  p.slots = inputs + 1;
  p.root = inputs;
  p.steps.push_back({op, inputs, {0}, {inputs > 1 ? 1 : -1}});
  return p;
}

}  // namespace

std::optional<VectorOp> direct_op(std::string_view name) {
  const std::optional<VectorOp> op = vector_op(name);
  if (!op) return std::nullopt;
  switch (*op) {
    case VectorOp::sqrt:  // ATen's is not the IEEE instruction here (fuse_kernels.hpp)
    case VectorOp::exp:   // the libm ones: ATen's scalar tail
    case VectorOp::log:
    case VectorOp::tanh:
    case VectorOp::sigmoid:
      return std::nullopt;
    default:
      return op;
  }
}

bool plain_cpu_operand(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided) return false;
  if (!kPlainCpu.isSupersetOf(t.key_set()) || t.unsafeGetTensorImpl()->is_wrapped_number() ||
      t.has_names())
    return false;
  if (at::GradMode::is_enabled() && t.requires_grad()) return false;
  // A forward-mode dual tensor carries its tangent in autograd metadata, not in its keys.
  if (t._fw_grad(/*level=*/0).defined()) return false;
  return t.is_contiguous();
}

// Nothing forced on this thread beyond c10's defaults (BackendSelect, ADInplaceOrView).
bool plain_cpu_thread() {
  return c10::default_included_set.isSupersetOf(c10::impl::tls_local_dispatch_key_set().included_);
}

at::Tensor direct_unary(VectorOp op, const at::Tensor& a) {
  if (!ready(op, a)) return {};
  const at::Tensor in[] = {a};
  return run(one_step(op, 1), in);
}

at::Tensor direct_binary(VectorOp op, const at::Tensor& a, const at::Tensor& b) {
  if (!ready(op, a) || !plain_cpu_operand(b) || b.scalar_type() != a.scalar_type() ||
      !a.sizes().equals(b.sizes()) || !b.strides().equals(a.strides()))
    return {};
  const at::Tensor in[] = {a, b};
  return run(one_step(op, 2), in);
}

at::Tensor direct_binary(VectorOp op, const at::Tensor& a, const at::Scalar& b) {
  if (!ready(op, a)) return {};
  const std::optional<VectorOperand> s = vector_number(op, b);
  // A floating number promotes an integer tensor to the default floating dtype: ATen's.
  if (!s || (!floating(a.scalar_type()) && !s->integral)) return {};
  VectorProgram p = one_step(op, 1);
  p.steps[0].b = *s;
  const at::Tensor in[] = {a};
  return run(p, in);
}

}  // namespace treetensor::detail
