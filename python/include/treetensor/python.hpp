#pragma once
// Passing trees between your own C++ Python extension and treetensor.torch (the Python wing,
// DESIGN.md §15), without copying tensor data: both sides hold the same leaf tensors.
//
//   // in a pybind11 function of your extension (GIL held):
//   treetensor::TreeTensor t = treetensor::python::from_python(obj.ptr());
//   py::object back = py::reinterpret_steal<py::object>(treetensor::python::to_python(t));
//
// The hand-over is a PyCapsule named "treetensor.TreeTensor" holding a heap TreeTensor
// (`Tensor._to_capsule()` / `treetensor.torch.Tensor._from_capsule(capsule)`), so it works
// across extension modules whatever pybind11 internals they use. Both sides must be built
// against the same treetensor headers and LibTorch (the TreeTensor layout crosses the boundary):
// build it with find_package(treetensor) from the installed Python package
// (treetensor.cmake_prefix_path), and it loads the package's shared libtreetensor, whose
// runtime (execution mode, lanes, asyncs workers) treetensor.torch uses too. Linked with a
// static libtreetensor (a plain CMake build's default) it would hold its own copy, whose tree
// calls ignore ttorch.stream. python/tests/interop/ is an example.

#include <Python.h>

#include <stdexcept>
#include <utility>

#include "treetensor/tensor/tree_tensor.hpp"

namespace treetensor::python {

inline constexpr const char* kCapsuleName = "treetensor.TreeTensor";

/// The tree of a treetensor.torch.Tensor (its node; the leaves are shared). Needs the GIL.
/// @throws std::invalid_argument when obj is not a treetensor.torch.Tensor (the Python error is
///         cleared).
inline TreeTensor from_python(PyObject* obj) {
  PyObject* cap = PyObject_CallMethod(obj, "_to_capsule", nullptr);
  void* p = cap ? PyCapsule_GetPointer(cap, kCapsuleName) : nullptr;
  if (!p) {
    Py_XDECREF(cap);
    PyErr_Clear();
    throw std::invalid_argument("treetensor: not a treetensor.torch.Tensor");
  }
  TreeTensor out = *static_cast<TreeTensor*>(p);
  Py_DECREF(cap);
  return out;
}

/// A new reference to a treetensor.torch.Tensor holding t (a leaf root gives its torch.Tensor),
/// or nullptr with a Python error set. Needs the GIL; imports treetensor.torch.
inline PyObject* to_python(TreeTensor t) {
  auto* heap = new TreeTensor(std::move(t));
  PyObject* cap = PyCapsule_New(heap, kCapsuleName, [](PyObject* c) {
    delete static_cast<TreeTensor*>(PyCapsule_GetPointer(c, kCapsuleName));
  });
  if (!cap) {
    delete heap;
    return nullptr;
  }
  PyObject* mod = PyImport_ImportModule("treetensor.torch");
  PyObject* cls = mod ? PyObject_GetAttrString(mod, "Tensor") : nullptr;
  PyObject* out = cls ? PyObject_CallMethod(cls, "_from_capsule", "O", cap) : nullptr;
  Py_XDECREF(cls);
  Py_XDECREF(mod);
  Py_DECREF(cap);
  return out;
}

}  // namespace treetensor::python
