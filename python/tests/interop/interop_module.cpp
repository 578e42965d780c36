// A separate C++ extension (plain CPython API, no pybind11) that exchanges trees with
// treetensor.torch through treetensor/python.hpp, as a user's extension would; built against
// the installed package (CMakeLists.txt beside it).
#include <Python.h>

#include <exception>

#include "treetensor/python.hpp"
#include "treetensor/runtime/stream.hpp"
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

// stream_mode(): the execution mode this extension's tree calls run in, e.g. "stream(2)". It
// is ttorch.stream's only when both load the one libtreetensor (one runtime per process).
PyObject* stream_mode(PyObject*, PyObject*) {
  return PyUnicode_FromString(treetensor::runtime::current_stream_mode().to_string().c_str());
}

PyMethodDef methods[] = {{"double_it", double_it, METH_O, nullptr},
                         {"same", same, METH_O, nullptr},
                         {"stream_mode", stream_mode, METH_NOARGS, nullptr},
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
