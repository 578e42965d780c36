// The module `treetensor._C`: the tree class (construction, access, printing, conversions), the
// error translation, and the module init that binds the rest (ops.cpp, runtime.cpp).
// Python-facing documentation lives in the docstrings here and in python/treetensor/*.py.

#include <c10/util/Exception.h>
#include <pybind11/eval.h>
#include <pybind11/stl.h>

#include <sstream>

#include "common.hpp"
#include "treetensor/python.hpp"

namespace treetensor::python {

namespace {
PyTypeObject* g_tree_type = nullptr;

[[noreturn]] void throw_type(const std::string& what) {
  throw py::type_error(what);
}

std::string repr_of(py::handle h) {
  return py::repr(h).cast<std::string>();
}

py::object child_object(const PyTree& self, const TensorTree& child, const std::string& key) {
  if (child.is_leaf()) return wrap_tensor(child.leaf());
  return py::cast(PyTree{self.root, self.path / key});
}

// A leaf-wise Python callback with the GIL held (indexing with Python keys): the leaf work is
// Python's own, so there is nothing to release.
// Errors name the leaf: "<op> at leaf 'a.b': <type>: <message>", with the original chained.
TensorTree map_py(const TensorTree& t, const py::function& fn, const char* op, tree::Path& where) {
  if (t.is_leaf()) {
    py::object r;
    try {
      r = fn(wrap_tensor(t.leaf()));
    } catch (py::error_already_set& e) {
      py::object exc = e.value();
      reraise(exc, std::string(op) + " at leaf '" + where.describe() + "': " +
                       Py_TYPE(exc.ptr())->tp_name + ": " + py::str(exc).cast<std::string>());
    }
    if (!is_tensor(r))
      throw_type(std::string(op) + " at leaf '" + where.describe() +
                 "': the leaf function must return a torch.Tensor");
    return TensorTree(at::Tensor(THPVariable_Unpack(r.ptr())));
  }
  TensorTree::Children ch;
  ch.reserve(t.size());
  for (const auto& [k, v] : t) {
    where.push_back(k);
    ch.emplace_back(k, map_py(v, fn, op, where));
    where.pop_back();
  }
  return TensorTree::from_children(std::move(ch));
}
TensorTree map_py(const PyTree& self, const py::function& fn, const char* op) {
  tree::Path where = self.path;
  return map_py(self.node(), fn, op, where);
}

std::string print(const TensorTree& t) {
  std::ostringstream os;
  if (t.is_leaf())
    os << format_tensor(t.leaf());
  else
    os << TreeTensor(t);
  return os.str();
}

}  // namespace

PyTypeObject* tree_type() {
  return g_tree_type;
}

namespace {
// Whether `t` is a single tensor. A consolidated result not yet looked at answers from its
// layout, so wrapping it does not make its leaf tensors (DESIGN.md §12).
bool leaf_root(const TreeTensor& t) {
  if (t.is_deferred())
    if (const ConsolidatedTree* c = consolidated_source(t))
      return c->layout().spec().node_count() == 1 && c->layout().leaves() == 1;
  return t.is_leaf();
}
}  // namespace

py::object wrap(TreeTensor t) {
  if (leaf_root(t)) return wrap_tensor(t.leaf());
  return py::cast(PyTree{std::make_shared<TreeTensor>(std::move(t)), {}});
}

TreeTensor to_tree(py::handle h, const tree::Path& at) {
  if (is_tree(h)) return TreeTensor(as_tree(h).node());
  if (PyDict_Check(h.ptr())) {
    TensorTree::Children ch;
    ch.reserve(PyDict_Size(h.ptr()));
    for (auto [k, v] : py::reinterpret_borrow<py::dict>(h)) {
      if (!PyUnicode_Check(k.ptr()))
        throw_type("treetensor: key " + repr_of(k) + " at '" + at.describe() +
                   "' is not a string (tree keys are strings)");
      std::string key = k.cast<std::string>();
      TensorTree sub = to_tree(v, at / key);
      ch.emplace_back(std::move(key), std::move(sub));
    }
    return TreeTensor(TensorTree::from_children(std::move(ch)));
  }
  if (is_tensor(h)) return TreeTensor(TensorTree(at::Tensor(THPVariable_Unpack(h.ptr()))));
  py::object t;
  try {
    t = py::module_::import("torch").attr("as_tensor")(h);
  } catch (py::error_already_set& e) {
    throw_type("treetensor: the value at '" + at.describe() + "' (" + repr_of(h) +
               ") is not a tensor, a dict or a value torch.as_tensor accepts: " + e.what());
  }
  return TreeTensor(TensorTree(at::Tensor(THPVariable_Unpack(t.ptr()))));
}

py::object to_dict(const TensorTree& t) {
  if (t.is_leaf()) return wrap_tensor(t.leaf());
  py::dict d;
  for (const auto& [k, v] : t) d[py::str(k)] = to_dict(v);
  return d;
}

Operand operand(py::handle h, Args& keep) {
  return keep.add(h);
}

Operand Args::add(py::handle h) {
  PyObject* o = h.ptr();
  if (is_tree(h)) {
    any_tree_ = true;
    return ops_.emplace_back(as_tree(h).node());
  }
  if (THPVariable_CheckExact(o) || THPVariable_Check(o))
    return ops_.emplace_back(tensors_.emplace_back(THPVariable_Unpack(o)));
  if (PyBool_Check(o)) return ops_.emplace_back(at::Scalar(o == Py_True));
  if (PyLong_Check(o)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow) throw py::value_error("treetensor: integer operand out of the int64 range");
    return ops_.emplace_back(at::Scalar(static_cast<int64_t>(v)));
  }
  if (PyFloat_Check(o)) return ops_.emplace_back(at::Scalar(PyFloat_AS_DOUBLE(o)));
  if (PyDict_Check(o)) {
    any_tree_ = true;
    return ops_.emplace_back(trees_.emplace_back(to_tree(h)));
  }
  throw_type("treetensor: unsupported operand " + repr_of(h) +
             " (a tree, a dict of tensors, a torch.Tensor or a number)");
}

at::ScalarType to_dtype(py::handle dtype) {
  if (!THPDtype_Check(dtype.ptr())) throw_type("treetensor: dtype must be a torch.dtype");
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

at::Device to_device(py::handle device) {
  if (THPDevice_Check(device.ptr())) return reinterpret_cast<THPDevice*>(device.ptr())->device;
  if (PyUnicode_Check(device.ptr())) return at::Device(device.cast<std::string>());
  throw_type("treetensor: device must be a torch.device or a string");
}

at::TensorOptions options(py::handle dtype, py::handle device) {
  at::TensorOptions o;
  if (dtype && !dtype.is_none()) o = o.dtype(to_dtype(dtype));
  if (device && !device.is_none()) o = o.device(to_device(device));
  return o;
}

}  // namespace treetensor::python

namespace {

using namespace treetensor::python;
namespace tree = treetensor::tree;
using treetensor::TensorTree;
using treetensor::TreeTensor;

void translate_errors() {
  // Registered last, tried first: the tree layer's typed errors and c10's errors (without
  // their C++ backtrace). Other std:: exceptions use pybind11's mapping (invalid_argument →
  // ValueError, out_of_range → IndexError, runtime_error → RuntimeError, ...).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tree::KeyError& e) {
      PyErr_SetObject(PyExc_KeyError, py::str(e.what()).ptr());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    } catch (const treetensor::asyncs::WatchdogTimeout& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    }
  });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  py::module_::import("torch");  // LibTorch's Python state (THPVariableClass, dtypes) first
  m.doc() = "treetensor's C++ core for Python; use the package `treetensor` (treetensor.torch).";
  translate_errors();

  // `Tensor(x)` with a non-tree x gives a plain torch.Tensor (DI-treetensor): the metaclass
  // decides before an instance exists.
  py::dict ns;
  ns["_base"] =
      py::handle(reinterpret_cast<PyObject*>(py::detail::get_internals().default_metaclass));
  py::exec(R"(
import torch as _torch
class TreeMeta(_base):
    def __call__(cls, data=None, *args, **kwargs):
        if data is None:
            data = {}
        if isinstance(data, (dict, cls)):
            return super().__call__(data, *args, **kwargs)
        if isinstance(data, _torch.Tensor) and not args and not kwargs:
            return data
        return _torch.tensor(data, *args, **kwargs)
)",
           ns);

  py::class_<PyTree> cls(m, "Tensor", py::metaclass(ns["TreeMeta"]), R"(A tree of tensors.

Tensor(dict) builds a tree from a nested dict with string keys (torch.Tensor leaves are
shared, not copied; other leaves go through torch.as_tensor). Tensor(x) of anything else gives
torch.tensor(x). Every tensor op applies leaf-wise through treetensor's runtime, with the GIL
released while leaf work runs.)");
  g_tree_type = reinterpret_cast<PyTypeObject*>(cls.ptr());

  cls.def(py::init([](py::handle data) {
            return PyTree{std::make_shared<TreeTensor>(to_tree(data)), {}};
          }),
          py::arg("data"));

  // ---- access ---------------------------------------------------------------------------------
  cls.def("__getattr__", [](const PyTree& self, const std::string& name) -> py::object {
    const TensorTree& n = self.node();
    const TensorTree* c = n.is_leaf() ? nullptr : n.find(tree::Path{name});
    if (!c)
      throw py::attribute_error("treetensor: no key '" + name + "' at '" + self.path.describe() +
                                "'");
    return child_object(self, *c, name);
  });
  cls.def("__getitem__", [](const PyTree& self, py::handle key) -> py::object {
    if (PyUnicode_Check(key.ptr())) {
      const std::string k = key.cast<std::string>();
      const TensorTree& n = self.node();
      const TensorTree* c = n.is_leaf() ? nullptr : n.find(tree::Path{k});
      if (!c) {
        std::string keys;
        if (!n.is_leaf())
          for (const auto& e : n) keys += (keys.empty() ? "" : ", ") + e.first;
        throw py::key_error("treetensor: no key '" + k + "' at '" + (self.path / k).describe() +
                            "'; available keys: {" + keys + "}");
      }
      return child_object(self, *c, k);
    }
    if (is_tree(key)) {
      const TreeTensor idx(as_tree(key).node());
      const TensorTree& n = self.node();
      return wrap(nogil([&] { return treetensor::index(n, idx); }));
    }
    py::object k = py::reinterpret_borrow<py::object>(key);
    py::function f = py::cpp_function([k](py::handle x) { return x[k]; });
    return wrap(TreeTensor(map_py(self, f, "index")));
  });
  auto set_child = [](PyTree& self, const std::string& key, py::handle value) {
    TensorTree& n = self.node_mut();
    if (n.is_leaf()) throw py::type_error("treetensor: '" + self.path.describe() + "' is a leaf");
    n.insert(tree::Path{key}, TensorTree(to_tree(value, self.path / key)));
  };
  cls.def("__setattr__", set_child);
  cls.def("__setitem__", [set_child](PyTree& self, py::handle key, py::handle value) {
    if (PyUnicode_Check(key.ptr())) return set_child(self, key.cast<std::string>(), value);
    // Leaf-wise assignment leaf[key] = value (value a tree zipped by path, else broadcast).
    const TensorTree& n = self.node();
    const auto flat = tree::flatten_refs(n);
    const auto paths = flat.spec.paths();
    const bool value_tree = is_tree(value);
    for (std::size_t i = 0; i < paths.size(); ++i) {
      py::object v = value_tree ? wrap_tensor(as_tree(value).node().at(paths[i]).leaf())
                                : py::reinterpret_borrow<py::object>(value);
      wrap_tensor(*flat.leaves[i])[key] = v;
    }
  });
  auto del_child = [](PyTree& self, const std::string& key) {
    TensorTree& n = self.node_mut();
    if (n.is_leaf() || !n.erase(tree::Path{key}))
      throw py::key_error("treetensor: no key '" + key + "' at '" + self.path.describe() + "'");
  };
  cls.def("__delattr__", del_child);
  cls.def("__delitem__", del_child);
  cls.def("__contains__", [](const PyTree& self, const std::string& key) {
    const TensorTree& n = self.node();
    return !n.is_leaf() && n.find(tree::Path{key}) != nullptr;
  });
  cls.def("__len__", [](const PyTree& self) { return self.node().size(); });
  cls.def(
      "keys",
      [](const PyTree& self) {
        py::list out;
        for (const auto& e : self.node()) out.append(py::str(e.first));
        return out;
      },
      "The keys of this node, sorted (a list).");
  cls.def(
      "values",
      [](const PyTree& self) {
        py::list out;
        for (const auto& [k, v] : self.node()) out.append(child_object(self, v, k));
        return out;
      },
      "The children of this node in key order: tensors for leaves, trees for subtrees.");
  cls.def(
      "items",
      [](const PyTree& self) {
        py::list out;
        for (const auto& [k, v] : self.node())
          out.append(py::make_tuple(py::str(k), child_object(self, v, k)));
        return out;
      },
      "(key, child) pairs in key order.");
  cls.def("__iter__", [](py::handle self) { return py::iter(self.attr("keys")()); });
  cls.def("__repr__", [](const PyTree& self) { return print(self.node()); });
  cls.def("__str__", [](const PyTree& self) { return print(self.node()); });
  cls.def(
      "to_dict", [](const PyTree& self) { return to_dict(self.node()); },
      "A nested dict of torch.Tensor sharing the leaves (the same Python tensor objects).");
  cls.def(
      "map",
      [](const PyTree& self, py::function fn) { return wrap(TreeTensor(map_py(self, fn, "map"))); },
      py::arg("fn"),
      "fn(leaf) on every leaf, on the calling thread with the GIL held (see ttorch.apply for "
      "the leaf-parallel form).");
  cls.def_property_readonly("_path", [](const PyTree& self) { return self.path.str(); });
  cls.def("_same_root",
          [](const PyTree& self, const PyTree& other) { return self.root == other.root; });

  // pickle / copy / deepcopy: the state is the nested dict of tensors (torch pickles those).
  cls.def(py::pickle([](const PyTree& self) { return to_dict(self.node()); },
                     [](py::object d) {
                       return PyTree{std::make_shared<TreeTensor>(to_tree(d)), {}};
                     }));

  // C++ interop (python/include/treetensor/python.hpp): a capsule holding a heap TreeTensor.
  cls.def(
      "_to_capsule",
      [](const PyTree& self) {
        auto* heap = new TreeTensor(self.node());
        return py::capsule(heap, treetensor::python::kCapsuleName, [](PyObject* c) {
          delete static_cast<TreeTensor*>(
              PyCapsule_GetPointer(c, treetensor::python::kCapsuleName));
        });
      },
      "A PyCapsule 'treetensor.TreeTensor' holding a C++ TreeTensor sharing the leaves.");
  cls.def_static(
      "_from_capsule",
      [](py::capsule c) {
        if (std::string(c.name() ? c.name() : "") != treetensor::python::kCapsuleName)
          throw py::type_error("treetensor: not a 'treetensor.TreeTensor' capsule");
        return wrap(TreeTensor(*c.get_pointer<TreeTensor>()));
      },
      "The tree held by a 'treetensor.TreeTensor' capsule (the leaves are shared).");

  m.def(
      "from_dict", [](py::handle d) { return wrap(to_tree(d)); }, py::arg("data"),
      "A tree from a nested dict (torch.Tensor leaves are shared).");
  m.def(
      "to_dict", [](py::handle t) { return to_dict(to_tree(t)); }, py::arg("tree"));

  bind_ops(m, cls);
  bind_runtime(m);
}
