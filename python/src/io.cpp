// treetensor.torch.load / save (DESIGN.md §11, §15): the io layer's Object as the Python object
// torch.load(weights_only=True) gives, and back. Dicts keep their keys' types (str or int) and
// the file's order, OrderedDicts, lists, tuples and sets stay what they were, Parameters stay
// nn.Parameter. Turning dicts into trees is the Python side's work (treetensor/torch.py).
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"
#include "treetensor/io/checkpoint.hpp"

namespace treetensor::python {
namespace {

namespace io = treetensor::io;
using Value = io::Value;
using ValueTree = tree::Tree<Value>;

// The deepest nesting save() writes: what the reader accepts (checkpoint.hpp).
constexpr std::size_t kMaxNesting = 1000;

// A class looked up once and kept for the process (never released: it outlives the module).
py::handle python_class(const char* module, const char* name) {
  return py::object(py::module_::import(module).attr(name)).release();
}
py::handle parameter_class() {
  static const py::handle cls = python_class("torch.nn", "Parameter");
  return cls;
}
py::handle ordered_dict_class() {
  static const py::handle cls = python_class("collections", "OrderedDict");
  return cls;
}

class ToPython {
 public:
  ToPython(const io::Object& object, std::string file) : object_(object), file_(std::move(file)) {}

  py::object value(const ValueTree& node) {
    if (node.is_leaf()) return leaf(node.leaf());
    switch (object_.kind(path_)) {
      case io::Container::list:
        return sequence(node);
      case io::Container::tuple:
        return py::tuple(sequence(node));
      case io::Container::set:
        return py::set(sequence(node));
      case io::Container::ordered_dict:
        return dict(node, ordered_dict_class()());
      case io::Container::dict:
        break;
    }
    return dict(node, py::dict());
  }

 private:
  py::object leaf(const Value& v) {
    return std::visit(
        [&](const auto& x) -> py::object {
          using X = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<X, std::monostate>) {
            return py::none();
          } else if constexpr (std::is_same_v<X, io::Bytes>) {
            return py::bytes(x.data);
          } else if constexpr (std::is_same_v<X, std::complex<double>>) {
            return py::reinterpret_steal<py::object>(PyComplex_FromDoubles(x.real(), x.imag()));
          } else if constexpr (std::is_same_v<X, at::ScalarType>) {
            return py::reinterpret_borrow<py::object>(
                reinterpret_cast<PyObject*>(torch::getTHPDtype(x)));
          } else if constexpr (std::is_same_v<X, at::Device>) {
            return py::reinterpret_steal<py::object>(THPDevice_New(x));
          } else if constexpr (std::is_same_v<X, at::Tensor>) {
            if (!object_.parameters.count(path_)) return wrap_tensor(x);
            return parameter_class()(wrap_tensor(x), x.requires_grad());
          } else if constexpr (std::is_same_v<X, std::string>) {
            return text(x, "the str");
          } else {
            return py::cast(x);
          }
        },
        v);
  }

  // A pickled str as pickle decodes it (BINUNICODE: UTF-8 with "surrogatepass", so a lone
  // surrogate reads as torch.load gives it; other invalid UTF-8 is torch.load's
  // UnicodeDecodeError too, its reason naming the file and where in the object it is).
  py::object text(const std::string& s, const char* what) const {
    PyObject* o =
        PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "surrogatepass");
    if (o) return py::reinterpret_steal<py::object>(o);
    py::error_already_set e;
    Py_ssize_t start = 0, end = 0;
    if (!e.matches(PyExc_UnicodeDecodeError) ||
        PyUnicodeDecodeError_GetStart(e.value().ptr(), &start) != 0 ||
        PyUnicodeDecodeError_GetEnd(e.value().ptr(), &end) != 0)
      throw e;
    py::object why =
        py::reinterpret_steal<py::object>(PyUnicodeDecodeError_GetReason(e.value().ptr()));
    const std::string raw = file_ + ": " + what + " at '" + path_.describe() + "' is not UTF-8 (" +
                            (why ? why.cast<std::string>() : std::string("invalid")) + ")";
    // The path's keys are surrogatepass UTF-8 (a lone surrogate is not UTF-8): escaped.
    const std::string reason =
        py::reinterpret_steal<py::str>(PyUnicode_DecodeUTF8(raw.data(),
                                                            static_cast<Py_ssize_t>(raw.size()),
                                                            "backslashreplace"))
            .cast<std::string>();
    PyObject* named = PyUnicodeDecodeError_Create(
        "utf-8", s.data(), static_cast<Py_ssize_t>(s.size()), start, end, reason.c_str());
    if (!named) throw py::error_already_set();
    PyErr_SetObject(PyExc_UnicodeDecodeError, named);
    Py_DECREF(named);
    throw py::error_already_set();
  }

  // A list's items sit under "0".."n-1", which the tree sorts as strings ("10" < "2").
  py::list sequence(const ValueTree& node) {
    std::vector<const ValueTree*> items(node.size());
    for (const auto& [key, child] : node) items.at(std::stoul(key)) = &child;
    py::list out;
    for (std::size_t i = 0; i < items.size(); ++i) out.append(at_key(std::to_string(i), *items[i]));
    return out;
  }

  py::object dict(const ValueTree& node, py::object out) {
    for (const std::string& key : file_order(node)) {
      path_.push_back(key);
      const bool int_key = object_.int_keys.count(path_) != 0;
      path_.pop_back();
      py::object k =
          int_key ? py::object(py::int_(std::stoll(key))) : text(key, "a key of the dict");
      out[k] = at_key(key, node[key]);
    }
    return out;
  }

  // object.hpp: key_order lists a dict's keys where the file's order is not the sorted one.
  std::vector<std::string> file_order(const ValueTree& node) const {
    if (auto it = object_.key_order.find(path_); it != object_.key_order.end()) return it->second;
    std::vector<std::string> keys;
    for (const auto& [key, child] : node) keys.push_back(key);
    return keys;
  }

  py::object at_key(const std::string& key, const ValueTree& child) {
    path_.push_back(key);
    py::object v = value(child);
    path_.pop_back();
    return v;
  }

  const io::Object& object_;
  std::string file_;  // for errors
  tree::Path path_;
};

std::string repr_of(py::handle h) {
  return py::repr(h).cast<std::string>();
}

[[noreturn]] void refuse(const tree::Path& at, const std::string& what,
                         const std::string& why = "") {
  throw py::type_error("treetensor.torch.save: cannot save " + what + " at '" + at.describe() +
                       "'" + (why.empty() ? "" : " (" + why + ")"));
}

class FromPython {
 public:
  io::Object take(py::handle h) {
    object_.tree = value(h);
    return std::move(object_);
  }

 private:
  ValueTree value(py::handle h) {
    if (path_.size() > kMaxNesting) {
      std::string where = path_.describe();
      if (where.size() > 200) where = where.substr(0, 200) + "...";
      throw py::value_error("treetensor.torch.save: containers nested deeper than " +
                            std::to_string(kMaxNesting) + " levels, at '" + where + "'");
    }
    PyObject* o = h.ptr();
    if (is_tree(h)) return tensors(as_tree(h).node());
    if (PyDict_Check(o)) return container(h, &FromPython::dict);
    // Its own dict: the walk below reads tensor trees among its values and refuses a cycle.
    if (py::isinstance(h, object_class())) return container(h.attr("_d"), &FromPython::dict);
    if (PyList_Check(o) || PyTuple_Check(o) || PyAnySet_CheckExact(o))
      return container(h, &FromPython::sequence);
    if (!PyLong_Check(o) && !PyFloat_Check(o) && !PyUnicode_Check(o) && !is_tensor(h))
      if (py::object d = foreign_dict(h); !d.is_none()) return dict(d);  // a treevalue TreeValue
    return ValueTree(leaf(h));
  }

  // A container met again inside itself is a cycle: refused naming both paths, as the tree
  // readers of nested dicts do, instead of running on to the nesting limit.
  ValueTree container(py::handle h, ValueTree (FromPython::*read)(py::handle)) {
    for (const auto& [open, depth] : open_)
      if (open == h.ptr()) {
        const tree::Path first(std::vector<std::string>(path_.begin(), path_.begin() + depth));
        throw py::value_error("treetensor.torch.save: the container at '" + path_.describe() +
                              "' is the one at '" + first.describe() +
                              "' again (a cycle): a file cannot hold one");
      }
    open_.emplace_back(h.ptr(), path_.size());
    ValueTree v = (this->*read)(h);
    open_.pop_back();
    return v;
  }

  Value leaf(py::handle h) {
    PyObject* o = h.ptr();
    if (o == Py_None) return std::monostate{};
    if (PyBool_Check(o)) return o == Py_True;
    if (PyLong_Check(o)) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow) refuse(path_, "an int outside the int64 range (" + repr_of(h) + ")");
      return static_cast<std::int64_t>(v);
    }
    if (PyFloat_Check(o)) return PyFloat_AS_DOUBLE(o);
    if (PyComplex_Check(o))
      return std::complex<double>(PyComplex_RealAsDouble(o), PyComplex_ImagAsDouble(o));
    if (PyUnicode_Check(o)) return utf8(h);
    if (PyBytes_Check(o)) return io::Bytes{h.cast<std::string>()};
    if (THPDtype_Check(o)) return to_dtype(h);
    if (THPDevice_Check(o)) return to_device(h);
    if (is_tensor(h)) {
      if (py::isinstance(h, parameter_class())) object_.parameters.insert(path_);
      return unpack_tensor(h);
    }
    refuse(path_, "a value of type '" + std::string(Py_TYPE(o)->tp_name) + "'",
           "it writes what torch.load(weights_only=True) reads: dicts with str or int keys, "
           "lists, tuples, sets, tensors, None, bool, int, float, complex, str, bytes, "
           "torch.dtype, torch.device");
  }

  ValueTree tensors(const TensorTree& t) {
    // A leaf's Python object (kept by torch while the tree holds the tensor) says whether it
    // is an nn.Parameter, as a dict's value does.
    if (t.is_leaf()) return ValueTree(leaf(wrap_tensor(t.leaf())));
    ValueTree::Children children;
    for (const auto& [key, child] : t) {
      path_.push_back(key);
      children.emplace_back(key, tensors(child));
      path_.pop_back();
    }
    return ValueTree::from_children(std::move(children));
  }

  ValueTree dict(py::handle h) {
    if (py::isinstance(h, ordered_dict_class())) object_.kinds[path_] = io::Container::ordered_dict;
    ValueTree::Children children;
    std::vector<std::string> order;
    for (auto [k, v] : py::reinterpret_borrow<py::dict>(h)) {
      order.push_back(key_of(k));
      path_.push_back(order.back());
      if (!PyUnicode_Check(k.ptr())) object_.int_keys.insert(path_);
      children.emplace_back(order.back(), value(v));
      path_.pop_back();
    }
    if (!std::is_sorted(order.begin(), order.end())) object_.key_order[path_] = std::move(order);
    try {
      return ValueTree::from_children(std::move(children));
    } catch (const std::invalid_argument&) {
      refuse(path_, "two keys that read alike (an int and a str with the same digits)");
    }
  }

  // A str as pickle writes it (UTF-8 with "surrogatepass": a lone surrogate, which torch.save
  // writes, too).
  static std::string utf8(py::handle s) {
    const py::object b = py::reinterpret_steal<py::object>(
        PyUnicode_AsEncodedString(s.ptr(), "utf-8", "surrogatepass"));
    if (!b) throw py::error_already_set();
    return b.cast<std::string>();
  }

  std::string key_of(py::handle k) const {
    if (PyUnicode_Check(k.ptr())) return utf8(k);
    if (PyLong_Check(k.ptr()) && !PyBool_Check(k.ptr())) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(k.ptr(), &overflow);
      if (!overflow) return std::to_string(v);
    }
    refuse(path_, "the key " + repr_of(k) + " (dict keys must be str or int64)");
  }

  ValueTree sequence(py::handle h) {
    if (PyList_Check(h.ptr()))
      object_.kinds[path_] = io::Container::list;
    else
      object_.kinds[path_] = PyTuple_Check(h.ptr()) ? io::Container::tuple : io::Container::set;
    ValueTree::Children children;
    std::size_t i = 0;
    for (py::handle item : h) {
      std::string key = std::to_string(i++);
      path_.push_back(key);
      children.emplace_back(std::move(key), value(item));
      path_.pop_back();
    }
    return ValueTree::from_children(std::move(children));
  }

  io::Object object_;
  tree::Path path_;
  std::vector<std::pair<PyObject*, std::size_t>> open_;  // containers being read, and their depth
};

}  // namespace

py::handle object_class() {
  static const py::handle cls = python_class("treetensor.common", "Object");
  return cls;
}

void bind_io(py::module_& m) {
  m.def(
      "_load",
      [](const std::string& path, py::handle map_location, bool mmap, const std::string& name) {
        io::LoadOptions options;
        if (!map_location.is_none()) options.device(to_device(map_location));
        options.mapped(mmap);
        io::Object object = nogil([&] { return io::load(path, options); });
        return ToPython(object, name.empty() ? path : name).value(object.tree);
      },
      py::arg("path"), py::arg("map_location") = py::none(), py::arg("mmap") = false,
      py::arg("name") = "",
      "The object of a torch.save file as torch.load(weights_only=True) gives it (io layer); name: "
      "what its errors call the file (default: path).");
  m.def(
      "_save",
      [](py::handle obj, const std::string& path) {
        io::Object object = FromPython().take(obj);
        nogil([&] { io::save(path, object); });
      },
      py::arg("obj"), py::arg("path"),
      "Writes obj as torch.save does (zip format); trees as nested dicts (io layer).");
}

}  // namespace treetensor::python
