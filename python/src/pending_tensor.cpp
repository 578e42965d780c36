// Tree-level results inside a pending asyncs scope (DESIGN.md §10, "pending scopes"). C++ cannot
// hand out an at::Tensor before it exists (ATen has no hook on a tensor's first read), but
// Python can: a torch.Tensor subclass sees every torch function, method and conversion through
// __torch_function__. So here a tree-level reduction is queued on the scope's thread, writing
// into a preallocated 0-d tensor, and Python gets treetensor.asyncs.PendingTensor, a wrapper
// standing for it, which waits for the job on every read (treetensor/asyncs.py).

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"

namespace treetensor::python {
namespace {

/// The job writing a PendingTensor. wait() is called by every read: it blocks (GIL released)
/// while the job runs, then joins the job's streams into the caller's current ones (CUDA: a
/// read on another stream or thread must wait too) and raises the job's error (type, op, leaf
/// path, "asyncs thread <id>, job <n>") at every read after a failure.
struct PendingJob {
  asyncs::Future<void> future;
  void wait() const {
    if (!future.ready()) {
      // A tree call converting this argument has handed out its operands' nodes already.
      const NextCallRootsUse use;
      wait_interruptibly([this](auto slice) { return future.wait_for(slice); });
      py::gil_scoped_release release;
      future.wait();
    }
    future.wait();  // done: no block, no GIL release
  }
};

PyTypeObject* pending_type_ = nullptr;  // set with the GIL held by the first result

py::object pending_class() {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> cls;
  const py::object& c = cls.call_once_and_store_result([] {
                             return py::module_::import("treetensor.asyncs").attr("PendingTensor");
                           })
                            .get_stored();
  pending_type_ = reinterpret_cast<PyTypeObject*>(c.ptr());
  return c;
}

/// A result and the job writing it (invalid: the result is made).
struct Queued {
  at::Tensor out;
  asyncs::Future<void> job;
};

/// Queues f(n) on `target` writing a preallocated result, or nothing when autograd records the
/// call or a leaf is quantized (then the call is made here). Runs with the GIL released: a pending
/// operand is made here (its leaves' dtypes decide the result's).
std::optional<Queued> queue(const asyncs::PendingTarget& target, Reduction op, std::string name,
                            const TensorTree& n, TreeLevelFn f) {
  const auto flat = tree::flatten_refs(n);
  std::vector<at::Tensor> reads;
  reads.reserve(flat.leaves.size());
  for (const at::Tensor* x : flat.leaves) {
    // A graph cannot be carried by a preallocated result; a quantized result's quantizer is
    // known only from the data.
    if ((x->requires_grad() && c10::GradMode::is_enabled()) || x->is_quantized())
      return std::nullopt;
    reads.push_back(*x);
  }
  const at::Device device = flat.leaves.empty() ? at::Device(at::kCPU) : flat.leaves[0]->device();
  // A default-dtype constant takes the default dtype of the call: the job may run after a
  // set_default_dtype, and 0 and NaN convert exactly.
  const auto type = reduction_dtype(op, n);
  at::Tensor out = at::empty(
      {}, at::TensorOptions(type.value_or(at::get_default_dtype_as_scalartype())).device(device));
  auto body = [copy = TreeTensor(n), out, f = std::move(f), name, constant = !type] {
    const at::Tensor r = f(copy);
    if ((r.scalar_type() != out.scalar_type() && !constant) || r.dim() != 0 ||
        r.device() != out.device())
      throw std::logic_error("treetensor internal error: tree-level " + name + " gave " +
                             c10::toString(r.scalar_type()) + " on " + r.device().str() +
                             " where its pending result was made " +
                             c10::toString(out.scalar_type()) + " on " + out.device().str());
    out.copy_(r);
  };
  auto job = target.submit(std::move(body), reads, {&out, 1}, "tree call " + name);
  return Queued{std::move(out), std::move(job)};
}

}  // namespace

py::object tree_level(Reduction op, const char* name, const TensorTree& n, TreeLevelFn f) {
  const auto target = asyncs::pending_target();
  // One GIL-released call either way: the pins on n's root (CallPins) cover only one.
  Queued r = nogil([&] {
    if (target)
      if (auto q = queue(target, op, name, n, f)) return std::move(*q);
    return Queued{f(n), {}};
  });
  if (!r.job.valid()) return wrap_tensor(r.out);
  return pending_class().attr("_make")(wrap_tensor(r.out), PendingJob{std::move(r.job)});
}

py::object pending_result(py::handle tensor) {
  // As treetensor/asyncs.py's _ready, without running Python code (which could let another
  // thread change the trees whose nodes this call has handed out).
  tensor.attr("_tt_job").cast<const PendingJob&>().wait();
  return tensor.attr("_tt_out");
}

bool is_pending_tensor(PyObject* o) noexcept {
  return pending_type_ != nullptr && Py_TYPE(o) == pending_type_;
}

void bind_pending(py::module_& m) {
  py::class_<PendingJob>(m, "_PendingJob")
      .def("wait", &PendingJob::wait,
           "Blocks (GIL released) until the job has run, joins its streams; raises its error, "
           "at every call.");
}

}  // namespace treetensor::python
