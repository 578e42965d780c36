// A separate C++ extension (plain CPython API, no pybind11) that exchanges trees with
// treetensor.torch through treetensor/python.hpp, as a user's extension would.
#include <Python.h>

#include <exception>

#include "treetensor/python.hpp"
#include "treetensor/tensor/ops.hpp"

namespace {

// double_it(tree): a new tree with every leaf times two, made in C++.
PyObject* double_it(PyObject*, PyObject* arg) {
  try {
    const treetensor::TreeTensor t = treetensor::python::from_python(arg);
    return treetensor::python::to_python(treetensor::mul(t, 2));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

// same(tree): the tree handed back unchanged (the same leaf tensors).
PyObject* same(PyObject*, PyObject* arg) {
  try {
    return treetensor::python::to_python(treetensor::python::from_python(arg));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

PyMethodDef methods[] = {{"double_it", double_it, METH_O, nullptr},
                         {"same", same, METH_O, nullptr},
                         {nullptr, nullptr, 0, nullptr}};
PyModuleDef module = {PyModuleDef_HEAD_INIT,
                      "_treetensor_interop",
                      nullptr,
                      -1,
                      methods,
                      nullptr,
                      nullptr,
                      nullptr,
                      nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__treetensor_interop() {
  return PyModule_Create(&module);
}
