// The single-pass optimizer steps for Python (DESIGN.md §12): treetensor.optim's Adam, AdamW
// and SGD call these with their state trees. The trees are updated in place (the same leaf
// tensors: a consolidated tree's buffers), with the GIL released.
#include <optional>
#include <string>

#include "common.hpp"
#include "treetensor/tensor/optim.hpp"

namespace treetensor::python {
namespace {

/// The tree behind argument `name` of `op` (its node; the leaf tensors are shared).
/// @throws TypeError for anything but a tree object.
TreeTensor tree_arg(py::handle h, const char* op, const char* name) {
  if (!is_tree(h))
    throw py::type_error(std::string(op) + ": " + name +
                         " must be a treetensor.torch.Tensor, got " + Py_TYPE(h.ptr())->tp_name);
  return TreeTensor(as_tree(h).node());
}

void adam_step(py::handle params, py::handle grads, py::handle exp_avg, py::handle exp_avg_sq,
               int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
               bool amsgrad, bool maximize, bool decoupled, py::handle max_exp_avg_sq) {
  const char* op = decoupled ? "adamw_step" : "adam_step";
  TreeTensor p = tree_arg(params, op, "params"), m = tree_arg(exp_avg, op, "exp_avg"),
             v = tree_arg(exp_avg_sq, op, "exp_avg_sq");
  const TreeTensor g = tree_arg(grads, op, "grads");
  std::optional<TreeTensor> vmax;
  if (!max_exp_avg_sq.is_none()) vmax = tree_arg(max_exp_avg_sq, op, "max_exp_avg_sq");
  const auto options = AdamOptions()
                           .lr(lr)
                           .betas(beta1, beta2)
                           .eps(eps)
                           .weight_decay(weight_decay)
                           .amsgrad(amsgrad)
                           .maximize(maximize);
  TreeTensor* mx = vmax ? &*vmax : nullptr;
  nogil([&] {
    if (decoupled)
      adamw_step_single_pass(p, g, m, v, step, options, mx);
    else
      adam_step_single_pass(p, g, m, v, step, options, mx);
  });
}

void sgd_step(py::handle params, py::handle grads, py::handle momentum_buffer, int64_t step,
              double lr, double momentum, double dampening, double weight_decay, bool nesterov,
              bool maximize) {
  TreeTensor p = tree_arg(params, "sgd_step", "params"),
             b = tree_arg(momentum_buffer, "sgd_step", "momentum_buffer");
  const TreeTensor g = tree_arg(grads, "sgd_step", "grads");
  const auto options = SgdOptions(lr)
                           .momentum(momentum)
                           .dampening(dampening)
                           .weight_decay(weight_decay)
                           .nesterov(nesterov)
                           .maximize(maximize);
  nogil([&] { sgd_step_single_pass(p, g, b, step, options); });
}

}  // namespace

void bind_optim(py::module_& m) {
  m.def("_adam_step", &adam_step, py::arg("params"), py::arg("grads"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("amsgrad"), py::arg("maximize"),
        py::arg("decoupled"), py::arg("max_exp_avg_sq") = py::none(),
        "One Adam (decoupled: AdamW) step in place, single pass (treetensor.optim.Adam).");
  m.def("_sgd_step", &sgd_step, py::arg("params"), py::arg("grads"), py::arg("momentum_buffer"),
        py::arg("step"), py::arg("lr"), py::arg("momentum"), py::arg("dampening"),
        py::arg("weight_decay"), py::arg("nesterov"), py::arg("maximize"),
        "One SGD step in place, single pass (treetensor.optim.SGD).");
}

}  // namespace treetensor::python
