// One elementwise op on one leaf without ATen's dispatcher (fuse_kernels.hpp): a one-step
// vector program, for the per-leaf kernels of the op table's elementwise tree calls.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "tensor/fuse_kernels.hpp"

namespace treetensor::detail {
namespace {

// The keys of a plain CPU tensor (its backend, autograd and in-place-or-view keys); any other
// (Python subclasses, functorch wrappers, ...) means ATen must see the call.
const c10::DispatchKeySet kPlainCpu{c10::DispatchKey::CPU, c10::DispatchKey::ADInplaceOrView,
                                    c10::DispatchKey::AutogradCPU, c10::DispatchKey::AutocastCPU};

bool floating(at::ScalarType d) {
  return d == at::kFloat || d == at::kDouble;
}

// Whether `op` on `dtype` is computed exactly as ATen computes it (fuse_kernels.hpp).
bool exact(VectorOp op, at::ScalarType dtype) {
  switch (op) {
    case VectorOp::sqrt:
    case VectorOp::exp:
    case VectorOp::log:
    case VectorOp::tanh:
    case VectorOp::sigmoid:
      return false;
    case VectorOp::div:
    case VectorOp::reciprocal:
      return floating(dtype);  // integer operands give floats
    default:
      return true;
  }
}

bool ready(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided) return false;
  const at::ScalarType d = t.scalar_type();
  if (!floating(d) && d != at::kLong && d != at::kInt) return false;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!kPlainCpu.isSupersetOf(t.key_set()) || impl->is_wrapped_number() || t.has_names())
    return false;
  if (at::GradMode::is_enabled() && t.requires_grad()) return false;
  return t.is_contiguous();
}

// Nothing forced on this thread beyond c10's defaults (BackendSelect, ADInplaceOrView).
bool thread_ready() {
  return c10::default_included_set.isSupersetOf(c10::impl::tls_local_dispatch_key_set().included_);
}

at::Tensor run(const VectorProgram& p, c10::ArrayRef<at::Tensor> in) {
  at::Tensor out = at::empty(in[0].sizes(), in[0].options());
  // 8 KiB blocks, as fuse(); one step needs no temporary.
  const int64_t block = (int64_t{8} << 10) / static_cast<int64_t>(in[0].element_size());
  run_vector_program(p, in, out, block, 0, in[0].numel());
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

at::Tensor direct_unary(VectorOp op, const at::Tensor& a) {
  if (!ready(a) || !exact(op, a.scalar_type()) || !thread_ready()) return {};
  const at::Tensor in[] = {a};
  return run(one_step(op, 1), in);
}

at::Tensor direct_binary(VectorOp op, const at::Tensor& a, const at::Tensor& b) {
  if (!ready(a) || !ready(b) || a.scalar_type() != b.scalar_type() || !exact(op, a.scalar_type()) ||
      !a.sizes().equals(b.sizes()) || !thread_ready())
    return {};
  const at::Tensor in[] = {a, b};
  return run(one_step(op, 2), in);
}

at::Tensor direct_binary(VectorOp op, const at::Tensor& a, const at::Scalar& b) {
  if (!ready(a) || !exact(op, a.scalar_type()) || !thread_ready()) return {};
  const std::optional<VectorOperand> s = vector_number(b);
  // A floating number promotes an integer tensor to the default floating dtype, and ATen
  // refuses a bool in a subtraction: ATen's.
  if (!s || (!floating(a.scalar_type()) && !s->integral) || (op == VectorOp::sub && b.isBoolean()))
    return {};
  VectorProgram p = one_step(op, 1);
  p.steps[0].b = *s;
  const at::Tensor in[] = {a};
  return run(p, in);
}

}  // namespace treetensor::detail
