// The module `treetensor._C`: the tree class (construction, access, printing, conversions), the
// error translation, and the module init that binds the rest (ops.cpp, runtime.cpp).
// Python-facing documentation lives in the docstrings here and in python/treetensor/*.py.

#include <c10/util/Exception.h>
#include <pybind11/detail/exception_translation.h>
#include <pybind11/eval.h>
#include <pybind11/stl.h>

#include <chrono>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

#include "common.hpp"
#include "treetensor/python.hpp"
#include "treetensor/tree/zip_rules.hpp"

namespace treetensor::python {

namespace {
PyTypeObject* g_tree_type = nullptr;
// treetensor.torch's fallback (tree, name) -> value, or None when torch has no such name: asked
// for a name that is neither a key nor a method; and its dict name -> leaf-wise function, which
// __getattr__ binds to the tree itself (the common case stays in C++). Owned for the process
// (never released at exit).
PyObject* g_attr_fallback = nullptr;
PyObject* g_attr_methods = nullptr;

// The class's __getattr__ (pybind11's function, which translates C++ exceptions).
PyObject* g_getattr = nullptr;

[[noreturn]] void throw_type(const std::string& what) {
  throw py::type_error(what);
}

std::string repr_of(py::handle h) {
  return py::repr(h).cast<std::string>();
}

// A new reference to the Python str of a key, made with the C API (cheaper than py::str).
PyObject* key_str(const std::string& key) {
  PyObject* s = PyUnicode_FromStringAndSize(key.data(), static_cast<Py_ssize_t>(key.size()));
  if (!s) throw py::error_already_set();
  return s;
}

// The str objects of node n's keys (n a node of self's root), made once per node while the
// root's keys stay: a listing then costs a reference per key, not a str (100 keys: keys()
// 2.1 -> 0.25 us). Stored after it is made: making strs may run a finalizer that lists again.
py::tuple key_strs(const PyTree& self, const TensorTree& n) {
  if (const py::object& cached = self.root->cache(n).keys)
    return py::reinterpret_borrow<py::tuple>(cached);
  py::tuple keys(n.is_leaf() ? 0 : n.size());
  Py_ssize_t i = 0;
  for (const auto& e : n) PyTuple_SET_ITEM(keys.ptr(), i++, key_str(e.first));
  self.root->cache(n).keys = keys;
  return keys;
}

py::object child_object(const PyTree& self, const TensorTree& child, const std::string& key) {
  if (child.is_leaf()) return wrap_tensor(child.leaf());
  tree::Path path = self.path / key;
  py::object constraint;
  if (self.constraint) {            // the child's part of it (Constraint.child), None for nothing
    const RootUse use(*self.root);  // Python code runs: the keys stay
    constraint = self.constraint.attr("child")(key);
    if (constraint.is_none()) constraint = py::object();
  }
  return py::cast(PyTree{self.root, std::move(path), std::move(constraint)});
}

// The node of `tree` when no node on its path is pending, found without a wait or a pin (the
// common case, on every method call); else nullptr.
const TensorTree* made_node(const PyTree& tree) {
  const TensorTree* n = tree.root.get();
  if (n->is_pending()) return nullptr;
  for (const std::string& key : tree.path) {
    n = n->find_child(key);
    if (n == nullptr || n->is_pending()) return nullptr;
  }
  return n;
}

// Whether no job that makes a node on `tree`'s path (an asyncs pending result, DESIGN.md §10)
// is still running; those done are made on the way (raising a failed job's error).
bool jobs_done(const PyTree& tree) {
  const TensorTree* n = tree.root.get();
  for (std::size_t i = 0;; ++i) {
    const TensorTree::Source* source = n->pending_source();
    if (source != nullptr && n->is_pending() && !source->wait_for(std::chrono::milliseconds(0)))
      return false;
    if (i == tree.path.size()) return true;
    n = n->find_child(tree.path[i]);
    if (n == nullptr) return true;  // node() raises the KeyError
  }
}

// The node whose keys come before methods: read as t.a reads it (a pending one waited for),
// except where a tree call made now goes pending (inside a pending asyncs scope) and its job
// still runs: nullptr, so that a method call on a pending result chains without a wait.
const TensorTree* node_for_keys(const PyTree& tree) {
  if (const TensorTree* n = made_node(tree)) return n;
  if (asyncs::pending_target() && !jobs_done(tree)) return nullptr;
  return &tree.node();
}

// DI-treetensor parity (treevalue's attribute rule): a key comes before a public method or
// property of the same name, so a tree with keys 'mean' and 'std' gives its children for
// t.mean and t.std. Returns the child; or nullptr where the method stands (no such key, a
// private name (the package's own), or inside a pending scope a result whose job still runs:
// its keys are known only once the job is done); or nullptr with a Python error set.
PyObject* key_before_method(PyObject* self, PyObject* name) {
  Py_ssize_t size = 0;
  const char* key = PyUnicode_AsUTF8AndSize(name, &size);
  if (key == nullptr || (size > 0 && key[0] == '_')) {
    PyErr_Clear();
    return nullptr;
  }
  try {
    const PyTree& tree = py::handle(self).cast<const PyTree&>();
    const TensorTree* n = node_for_keys(tree);
    if (n == nullptr || n->is_leaf()) return nullptr;
    const std::string_view k(key, size);
    if (const TensorTree* c = n->find_child(k))
      return child_object(tree, *c, std::string(k)).release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (...) {
    py::detail::try_translate_exceptions();
  }
  return nullptr;
}

// Attribute access of exact trees: a key (before a method of the same name, see above); a name
// of the type (a method, a property) as Python's own lookup finds it; else a name of
// treetensor.torch's fallback, answered here without the AttributeError a failed generic
// lookup makes before Python calls __getattr__ (t.a is DI-treetensor code's most common
// call). Everything else, errors included, goes through __getattr__. Subclasses (instance
// dicts) keep the generic lookup first.
PyObject* tree_getattro(PyObject* self, PyObject* name) {
  const bool exact = Py_TYPE(self) == g_tree_type && PyUnicode_Check(name);
  const bool typed = exact && _PyType_Lookup(Py_TYPE(self), name) != nullptr;
  if (typed) {
    if (PyObject* child = key_before_method(self, name)) return child;
    if (PyErr_Occurred()) return nullptr;
  }
  if (!exact || typed) {
    PyObject* r = PyObject_GenericGetAttr(self, name);
    if (r || !PyErr_ExceptionMatches(PyExc_AttributeError)) return r;
    PyErr_Clear();
    return PyObject_CallFunctionObjArgs(g_getattr, self, name, nullptr);
  }
  const PyTree& tree = py::handle(self).cast<const PyTree&>();
  const TensorTree* node = nullptr;
  try {
    // Raised here, not retried through __getattr__: a pending tree's job error (raised by the
    // first read only, for an in-place call's target) and a KeyboardInterrupt of its wait.
    node = &tree.node();
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
  try {
    const TensorTree& n = *node;
    Py_ssize_t size = 0;
    const char* key = PyUnicode_AsUTF8AndSize(name, &size);
    if (key && !n.is_leaf()) {
      if (const TensorTree* c = n.find(tree::Path{std::string(key, size)}))
        return child_object(tree, *c, std::string(key, size)).release().ptr();
    }
    if (key && g_attr_methods && (size < 2 || key[0] != '_' || key[1] != '_')) {
      if (PyObject* fn = PyDict_GetItemWithError(g_attr_methods, name)) {
        // A function binds as a method, a property gives its value: the descriptor protocol.
        if (descrgetfunc get = Py_TYPE(fn)->tp_descr_get)
          return get(fn, self, reinterpret_cast<PyObject*>(Py_TYPE(self)));
        Py_INCREF(fn);
        return fn;
      }
    }
  } catch (...) {  // NOLINT(bugprone-empty-catch): __getattr__ raises it, translated
  }
  PyErr_Clear();
  return PyObject_CallFunctionObjArgs(g_getattr, self, name, nullptr);
}

// A leaf-wise Python callback with the GIL held (indexing with Python keys): the leaf work is
// Python's own, so there is nothing to release.
// Errors keep their type and name the leaf: "<op> at leaf 'a.b': <message>", with the original
// chained.
TensorTree map_py(const TensorTree& t, const py::function& fn, const char* op, tree::Path& where) {
  if (t.is_leaf()) {
    // One vectorcall: pybind11's fn(x) makes an argument tuple per leaf, and those tuples
    // (tracked by Python's GC) start a collection every few hundred leaves.
    py::object leaf = wrap_tensor(t.leaf());
    PyObject* argv[] = {leaf.ptr()};
    auto r = py::reinterpret_steal<py::object>(PyObject_Vectorcall(fn.ptr(), argv, 1, nullptr));
    if (!r) {
      py::error_already_set e;
      py::object exc = e.value();
      reraise(exc, std::string(op) + " at leaf '" + where.describe() +
                       "': " + py::str(exc).cast<std::string>());
    }
    if (!is_tensor(r))
      throw_type(std::string(op) + " at leaf '" + where.describe() +
                 "': the leaf function must return a torch.Tensor");
    return TensorTree(unpack_tensor(r));
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
  const RootUse use(*self.root);  // fn is Python code: the keys stay while map walks them
  tree::Path where = self.path;
  return map_py(self.node(), fn, op, where);
}

// "{a, b, ...}": the first keys of a node, for errors about a key it lacks.
std::string key_list(const TensorTree& n) {
  constexpr std::size_t kShown = 10;
  std::string keys;
  std::size_t i = 0;
  if (!n.is_leaf())
    for (const auto& e : n) {
      if (i++ == kShown) {
        keys += ", ... (" + std::to_string(n.size()) + " keys)";
        break;
      }
      keys += (keys.empty() ? "" : ", ") + e.first;
    }
  return "{" + keys + "}";
}

// A name that is neither a key nor a tree method: say which keys there are, and whether the
// name is torch.Tensor's (a method a user expects to work leaf-wise).
std::string missing_attribute(const PyTree& self, const TensorTree& n, const std::string& name) {
  std::string text = "treetensor: no key '" + name + "' at '" + self.path.describe() +
                     "'; available keys: " + key_list(n);
  const py::object tensor = py::module_::import("torch").attr("Tensor");
  if (name.rfind("__", 0) != 0 && py::hasattr(tensor, name.c_str())) {
    const bool method = PyCallable_Check(tensor.attr(name.c_str()).ptr()) != 0;
    text += "; '" + name + "' is a torch.Tensor " + (method ? "method" : "attribute") +
            " that tree tensors do not provide (yet): use t.map(lambda x: x." + name +
            (method ? "(...)" : "") + ") or ttorch.apply";
  } else if (name.rfind("__", 0) != 0) {
    text += "; nor is it a name of torch.Tensor, which a tree would apply leaf-wise";
  }
  return text;
}

// fn(leaf, *args, **kwargs) on every leaf with the GIL held (treetensor.torch's fallback to
// torch: Python's own leaf work). The leaves are copied first: fn may change this tree's keys.
// A tree when every result is a tensor, else the nested dict of the results; a leaf's exception
// keeps its type, with "<op> at leaf '<path>': " prepended (reraise).
py::object leaf_call(const PyTree& self, py::handle fn, const py::tuple& args,
                     const py::dict& kwargs, const std::string& op) {
  auto flat = tree::flatten(self.node());
  const std::size_t n = flat.leaves.size(), k = args.size();
  std::vector<py::object> out(n);
  bool tensors = true;
  for (std::size_t i = 0; i < n; ++i) {
    py::object call_args = py::reinterpret_steal<py::object>(PyTuple_New(k + 1));
    PyTuple_SET_ITEM(call_args.ptr(), 0, wrap_tensor(flat.leaves[i]).release().ptr());
    for (std::size_t j = 0; j < k; ++j) {
      PyObject* a = PyTuple_GET_ITEM(args.ptr(), j);
      Py_INCREF(a);
      PyTuple_SET_ITEM(call_args.ptr(), j + 1, a);
    }
    PyObject* r = PyObject_Call(fn.ptr(), call_args.ptr(), kwargs.ptr());
    if (!r) {
      py::error_already_set e;
      tree::Path where = self.path;
      const auto paths = flat.spec.paths();
      for (const auto& key : paths[i]) where.push_back(key);
      reraise(e.value(), op + " at leaf '" + where.describe() +
                             "': " + py::str(e.value()).cast<std::string>());
    }
    out[i] = py::reinterpret_steal<py::object>(r);
    tensors = tensors && is_tensor(out[i]);
  }
  if (tensors) {
    std::vector<at::Tensor> ts(n);
    for (std::size_t i = 0; i < n; ++i) ts[i] = unpack_tensor(out[i]);
    return wrap(TreeTensor(tree::unflatten(flat.spec, std::move(ts))));
  }
  const auto paths = flat.spec.paths();
  py::dict root;
  for (std::size_t i = 0; i < n; ++i) {
    if (paths[i].empty()) return out[i];  // a single-leaf root
    py::dict d = root;
    const auto& p = paths[i];
    for (std::size_t j = 0; j + 1 < p.size(); ++j) {
      py::str key(p[j]);
      if (!d.contains(key)) d[key] = py::dict();
      d = d[key].cast<py::dict>();
    }
    d[py::str(p[p.size() - 1])] = out[i];
  }
  return root;
}

// A copy of child `key` of `n` (empty without one), kept by the caller until its change of `n`
// is done: the child's tensors then die after it. A tensor whose Python object the tree owned
// dies through torch's dealloc, which releases the GIL (THPVariable_clear), and another Python
// thread could then start a call on the tree half changed.
TensorTree outlive_change(const TensorTree& n, const std::string& key) {
  const TensorTree* child = n.is_leaf() ? nullptr : n.find(tree::Path{key});
  return child ? *child : TensorTree();
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
struct Pin {
  std::weak_ptr<Root> root;
  std::uint64_t version;  // the root's when its node was handed out
};
std::vector<Pin>& next_call_roots() {
  thread_local std::vector<Pin> roots;
  return roots;
}
}  // namespace

void pin_next_call(const std::shared_ptr<Root>& root) {
  auto& pins = next_call_roots();
  if (!pins.empty() && pins.back().version == root->version &&
      !pins.back().root.owner_before(root) && !root.owner_before(pins.back().root))
    return;
  if (pins.size() == kMaxPins) pins.erase(pins.begin());
  pins.push_back({root, root->version});
}

namespace {
// The package's folder ("/.../treetensor/"), set by the module's init: a warning's frame skips
// the package's Python wrappers of the bindings.
std::string& package_folder() {
  static auto* folder = new std::string;  // never destroyed: read until the interpreter ends
  return *folder;
}

// warnings.warn's stacklevel naming the innermost frame outside the package: a warning names
// the user's line, as torch's name theirs, whichever wrapper of the package called the binding.
int user_stack_level() {
  int level = 1;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr && !package_folder().empty()) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    const char* file = PyUnicode_AsUTF8(code->co_filename);
    Py_DECREF(code);
    if (file == nullptr) {
      PyErr_Clear();
      break;
    }
    if (!std::string_view(file).starts_with(package_folder())) break;
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
    ++level;
  }
  Py_XDECREF(frame);
  return level;
}
}  // namespace

PythonWarnings::~PythonWarnings() noexcept(false) {
  c10::WarningUtils::set_warning_handler(previous_);
  for (const c10::Warning& w : caught_.warnings) {
    PyObject* category = std::holds_alternative<c10::DeprecationWarning>(w.type())
                             ? PyExc_DeprecationWarning
                             : PyExc_UserWarning;
    std::string text = w.msg();
    if (!w.verbatim())  // as torch words it
      text += " (Triggered internally at " + std::string(w.source_location().file) + ":" +
              std::to_string(w.source_location().line) + ".)";
    if (PyErr_WarnEx(category, text.c_str(), user_stack_level()) == 0) continue;
    if (std::uncaught_exceptions() > unwinding_) {
      PyErr_Clear();
      continue;
    }
    throw py::error_already_set();
  }
}

CallPins::CallPins() {
  // An entry whose root changed since is left out: it comes from an access that made no call
  // (t.a, keys()) before another thread changed that tree, and this call does not read it.
  auto& next = next_call_roots();
  for (const auto& p : next)
    if (auto r = p.root.lock(); r && r->version == p.version) {
      r->users.fetch_add(1, std::memory_order_relaxed);
      roots_[count_++] = std::move(r);
    }
  next.clear();
}

NextCallRootsUse::NextCallRootsUse() {
  for (const auto& p : next_call_roots())
    if (auto r = p.root.lock(); r && r->version == p.version) {
      r->users.fetch_add(1, std::memory_order_relaxed);
      roots_[count_++] = std::move(r);
    }
}

NextCallRootsUse::~NextCallRootsUse() {
  for (std::size_t i = 0; i < count_; ++i) roots_[i]->users.fetch_sub(1, std::memory_order_relaxed);
}

CallPins::~CallPins() {
  for (std::size_t i = 0; i < count_; ++i) roots_[i]->users.fetch_sub(1, std::memory_order_relaxed);
}

py::object torch_leafwise(py::handle self, const char* name, const py::args& args,
                          const py::kwargs& kwargs) {
  if (g_attr_fallback == nullptr)
    throw py::type_error(std::string("treetensor: ") + name + "(): arguments it does not take");
  return py::reinterpret_borrow<py::object>(g_attr_fallback)(self, name)(*args, **kwargs);
}

void detach_views(Root& root, const tree::Path& changed, const TensorTree& old) {
  std::shared_ptr<Root> kept;  // made for the first view below `changed`, shared by the others
  for (PyTree* v = root.views; v != nullptr;) {
    PyTree* next = v->next_view();  // rebase unlinks v
    const tree::Path& p = v->path;
    if (p.size() >= changed.size() && std::equal(changed.begin(), changed.end(), p.begin())) {
      if (!kept) kept = std::make_shared<Root>(TreeTensor(old));
      v->rebase(kept, tree::Path(std::vector<std::string>(p.begin() + changed.size(), p.end())));
    }
    v = next;
  }
}

void begin_change(Root& root, const tree::Path& where) {
  // Both sides hold the GIL here: a call counts itself before it releases the GIL.
  ++root.version;
  next_call_roots().clear();  // this thread's earlier accesses are not part of a call
  if (root.users.load(std::memory_order_relaxed) != 0)
    throw std::runtime_error(
        "treetensor: cannot change the keys at '" + where.describe() +
        "' while a tree call reads this tree (from a callback of that call or another Python "
        "thread); change a copy, or wait for the call to return");
}

namespace {
// Whether `t` is a single tensor. A consolidated result not yet looked at answers from its
// layout, so wrapping it does not make its leaf tensors (DESIGN.md §12).
bool leaf_root(const TreeTensor& t) {
  if (t.is_pending()) return false;  // a pending result of tree operands: a tree (not waited for)
  if (t.is_deferred())
    if (const ConsolidatedTree* c = consolidated_source(t))
      return c->layout().spec().node_count() == 1 && c->layout().leaves() == 1;
  return t.is_leaf();
}
}  // namespace

py::object wrap(TreeTensor t) {
  if (leaf_root(t)) return wrap_tensor(t.leaf());
  return py::cast(PyTree{std::make_shared<Root>(std::move(t)), {}, {}});
}

namespace {
// The nested dict of a treetensor.common.Object (a treetensor.numpy tree among them: DI-treetensor
// builds tensor trees from its numpy trees), else None.
py::object object_dict(py::handle h) {
  if (PyDict_GetItemString(PyImport_GetModuleDict(), "treetensor.common") == nullptr)
    return py::none();  // nothing can be an Object yet
  return py::isinstance(h, object_class()) ? py::object(h.attr("_d")) : py::none();
}

// An index for every leaf: a flat list of ints (or of bools) as the tensor torch makes of it,
// made once here rather than by torch at every leaf (t[[0, 1]] on 3 leaves: 44 -> 10 us); any
// other key as it is (a nested list is a tuple index to torch, not a tensor).
py::object list_index(py::handle key) {
  if (!PyList_Check(key.ptr()) || PyList_GET_SIZE(key.ptr()) == 0)
    return py::reinterpret_borrow<py::object>(key);
  const bool bools = PyBool_Check(PyList_GET_ITEM(key.ptr(), 0));
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(key.ptr()); ++i) {
    PyObject* v = PyList_GET_ITEM(key.ptr(), i);
    if (!PyLong_Check(v) || bool(PyBool_Check(v)) != bools)
      return py::reinterpret_borrow<py::object>(key);
  }
  try {
    PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> tensor;
    return tensor
        .call_once_and_store_result([] { return py::module_::import("torch").attr("tensor"); })
        .get_stored()(key);
  } catch (py::error_already_set&) {  // an int beyond int64: torch's own error, per leaf
    return py::reinterpret_borrow<py::object>(key);
  }
}

// The first `depth` keys of `where`, for an error about a dict met deeper.
std::string path_prefix(const tree::Path& where, std::size_t depth) {
  depth = std::min(depth, where.size());
  return tree::Path(std::vector<std::string>(where.begin(), where.begin() + depth)).describe();
}

}  // namespace

void OpenDicts::enter(py::handle h, const tree::Path& where) {
  const auto [it, fresh] = open_.emplace(h.ptr(), where.size());
  if (!fresh)
    throw py::value_error("treetensor: the dict at '" + where.describe() + "' is the dict at '" +
                          path_prefix(where, it->second) +
                          "' again (a cycle): a tree cannot contain itself");
  if (where.size() >= kMaxDepth) {
    open_.erase(it);
    throw py::value_error("treetensor: dicts nested deeper than " + std::to_string(kMaxDepth) +
                          " levels at '" + path_prefix(where, 32) + "...' (" +
                          std::to_string(where.size()) + " keys)");
  }
}

namespace {

// One walk over a nested dict. `where` is the path of `h`, pushed and popped (never copied per
// level: its text is made only for an error).
struct DictWalk {
  tree::Path where;
  OpenDicts open;

  TensorTree dict(py::handle h) {
    open.enter(h, where);
    TensorTree::Children ch;
    ch.reserve(PyDict_Size(h.ptr()));
    for (auto [k, v] : py::reinterpret_borrow<py::dict>(h)) {
      if (!PyUnicode_Check(k.ptr()))
        throw_type("treetensor: key " + repr_of(k) + " at '" + where.describe() +
                   "' is not a string (tree keys are strings)");
      std::string key = k.cast<std::string>();
      where.push_back(key);
      TensorTree sub = value(v);
      where.pop_back();
      ch.emplace_back(std::move(key), std::move(sub));
    }
    open.leave(h);
    return TensorTree::from_children(std::move(ch));
  }
  TensorTree value(py::handle h) {
    if (is_tree(h)) return as_tree(h).node();
    if (PyDict_Check(h.ptr())) return dict(h);
    if (is_tensor(h)) return TensorTree(unpack_tensor(h));
    if (!PyLong_Check(h.ptr()) && !PyFloat_Check(h.ptr())) {
      if (py::object d = object_dict(h); !d.is_none()) return dict(d);
      if (py::object d = foreign_dict(h); !d.is_none()) return dict(d);
    }
    py::object t;
    try {
      t = py::module_::import("torch").attr("as_tensor")(h);
    } catch (py::error_already_set& e) {
      throw_type("treetensor: the value at '" + where.describe() + "' (" + repr_of(h) +
                 ") is not a tensor, a dict or a value torch.as_tensor accepts: " + e.what());
    }
    return TensorTree(unpack_tensor(t));
  }
};
}  // namespace

namespace {
// treetensor.common's function `name`, looked up once.
const py::object& common_function(const char* name,
                                  py::gil_safe_call_once_and_store<py::object>& slot) {
  return slot
      .call_once_and_store_result(
          [name] { return py::module_::import("treetensor.common").attr(name); })
      .get_stored();
}

bool treevalue_imported() {
  return PyDict_GetItemString(PyImport_GetModuleDict(), "treevalue") != nullptr;
}
}  // namespace

bool is_foreign_tree(py::handle h) {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> fn;
  return treevalue_imported() && common_function("_is_foreign_tree", fn)(h).cast<bool>();
}

py::object foreign_dict(py::handle h) {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> fn;
  if (!treevalue_imported()) return py::none();  // nothing can be a TreeValue yet
  return common_function("_foreign_dict", fn)(h);
}

TreeTensor to_tree(py::handle h, const tree::Path& at) {
  DictWalk walk{at, {}};
  return TreeTensor(walk.value(h));
}

py::object to_dict(const TensorTree& t) {
  if (t.is_leaf()) return wrap_tensor(t.leaf());
  py::dict d;
  for (const auto& [k, v] : t) d[py::str(k)] = to_dict(v);
  return d;
}

namespace {
// numpy.generic and numpy.ndarray, once numpy is imported (before, nothing is an instance).
const std::pair<py::object, py::object>* numpy_types() {
  PyObject* np = PyDict_GetItemString(PyImport_GetModuleDict(), "numpy");
  if (np == nullptr) return nullptr;
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<std::pair<py::object, py::object>>
      types;
  return &types
              .call_once_and_store_result([np] {
                const py::handle m(np);
                return std::pair<py::object, py::object>(m.attr("generic"), m.attr("ndarray"));
              })
              .get_stored();
}
}  // namespace

py::object numpy_scalar_item(py::handle h) {
  const auto* types = numpy_types();
  if (types == nullptr || !py::isinstance(h, types->first)) return py::object();
  return h.attr("item")();
}

bool is_ndarray(py::handle h) {
  const auto* types = numpy_types();
  return types != nullptr && py::isinstance(h, types->second);
}

Operand operand(py::handle h, Args& keep) {
  return keep.add(h);
}

Operand Args::add(py::handle h) {
  PyObject* o = h.ptr();
  if (is_tree(h)) {
    any_tree_ = true;
    return ops_.emplace_back(as_tree(h).operand());
  }
  if (THPVariable_CheckExact(o) || THPVariable_Check(o))
    return ops_.emplace_back(tensors_.emplace_back(unpack_tensor(h)));
  if (PyBool_Check(o)) return ops_.emplace_back(at::Scalar(o == Py_True));
  if (PyLong_Check(o)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow) throw py::value_error("treetensor: integer operand out of the int64 range");
    return ops_.emplace_back(at::Scalar(static_cast<int64_t>(v)));
  }
  if (PyFloat_Check(o)) return ops_.emplace_back(at::Scalar(PyFloat_AS_DOUBLE(o)));
  if (PyComplex_Check(o))  // as torch: t + 1j is complex
    return ops_.emplace_back(
        at::Scalar(c10::complex<double>(PyComplex_RealAsDouble(o), PyComplex_ImagAsDouble(o))));
  if (PyDict_Check(o)) {
    any_tree_ = true;
    return ops_.emplace_back(trees_.emplace_back(to_tree(h)));
  }
  if (py::object d = foreign_dict(h); !d.is_none()) {
    any_tree_ = true;
    return ops_.emplace_back(trees_.emplace_back(to_tree(d)));
  }
  // numpy operands as torch takes them: a scalar as its number, an array as a tensor.
  if (py::object v = numpy_scalar_item(h); v && !numpy_scalar_item(v)) return add(v);
  if (is_ndarray(h)) {
    const py::object t = py::module_::import("torch").attr("as_tensor")(h);
    return ops_.emplace_back(tensors_.emplace_back(unpack_tensor(t)));
  }
  throw_type("treetensor: unsupported operand " + repr_of(h) +
             " (a tree, a dict of tensors or a treevalue TreeValue, a torch.Tensor, a numpy "
             "array or a number)");
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
    } catch (const tree::StructureError& e) {
      // Python has no inherit argument: the functions that broadcast a leaf into a subtree
      // (treetensor.torch's operators, DI-treetensor parity) do so on their own.
      std::string text = e.what();
      if (const auto hint = text.find(tree::kInheritHint); hint != std::string::npos)
        text.erase(hint, tree::kInheritHint.size());
      PyErr_SetString(PyExc_ValueError, text.c_str());
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
  m.attr("__version__") = TREETENSOR_VERSION;  // CMake's project version (python/CMakeLists.txt)
  translate_errors();
  // The package imports _C first thing: its module object, with __path__, exists already.
  if (PyObject* package = PyDict_GetItemString(PyImport_GetModuleDict(), "treetensor"))
    if (py::object path = py::getattr(package, "__path__", py::none()); !path.is_none())
      package_folder() = py::str(path[py::int_(0)]).cast<std::string>() + "/";

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
            return PyTree{std::make_shared<Root>(to_tree(data)), {}, {}};
          }),
          py::arg("data"));

  // ---- access ---------------------------------------------------------------------------------
  cls.def("__getattr__", [](py::handle h, const std::string& name) -> py::object {
    // Reached through tree_getattro for what its fast path does not answer.
    const PyTree& self = as_tree(h);
    const TensorTree& n = self.node();
    const TensorTree* c = n.is_leaf() ? nullptr : n.find(tree::Path{name});
    if (c) return child_object(self, *c, name);
    // Keys first, then torch's own names leaf-wise (DI-treetensor's fallback to torch).
    if (g_attr_fallback && name.rfind("__", 0) != 0) {
      if (PyObject* fn = PyDict_GetItemString(g_attr_methods, name.c_str()))
        return py::reinterpret_steal<py::object>(PyMethod_New(fn, h.ptr()));
      py::object r = py::reinterpret_borrow<py::object>(g_attr_fallback)(h, name);
      if (!r.is_none()) return r;
    }
    throw py::attribute_error(missing_attribute(self, n, name));
  });
  g_getattr = py::object(cls.attr("__getattr__")).release().ptr();
  g_tree_type->tp_getattro = tree_getattro;
  PyType_Modified(g_tree_type);
  cls.def("__getitem__", [](const PyTree& self, py::handle key) -> py::object {
    if (PyUnicode_Check(key.ptr())) {
      const std::string k = key.cast<std::string>();
      const TensorTree& n = self.node();
      const TensorTree* c = n.is_leaf() ? nullptr : n.find(tree::Path{k});
      if (!c)
        throw py::key_error("treetensor: no key '" + k + "' at '" + self.path.describe() +
                            "'; available keys: " + key_list(n));
      return child_object(self, *c, k);
    }
    if (is_tree(key)) {
      const TreeTensor idx(as_tree(key).node());
      const TensorTree& n = self.node();
      return wrap(nogil([&] { return treetensor::index(n, idx); }));
    }
    py::object k = list_index(key);
    py::function f = py::cpp_function([k](py::handle x) { return x[k]; });
    return wrap(TreeTensor(map_py(self, f, "index")));
  });
  auto set_child = [](PyTree& self, const std::string& key, py::handle value) {
    // The node itself given back (`t.b += 1` is `t.b = t.b.__iadd__(1)`, also `t.b = t.b`):
    // nothing changes, and its views stay views of `t`.
    if (is_tree(value)) {
      const PyTree& v = as_tree(value);
      if (v.root == self.root && v.path.size() == self.path.size() + 1 &&
          v.path[self.path.size()] == key &&
          std::equal(self.path.begin(), self.path.end(), v.path.begin()))
        return;
    }
    // Converted first: torch.as_tensor may run Python code, and so let another thread start a
    // call on this tree, which the change must then see (node_mut).
    TensorTree sub(to_tree(value, self.path / key));
    TensorTree& n = self.node_mut();
    if (n.is_leaf()) throw py::type_error("treetensor: '" + self.path.describe() + "' is a leaf");
    const TensorTree replaced = outlive_change(n, key);
    if (self.root->views && !n.is_leaf() && n.find_child(key))
      detach_views(*self.root, self.path / key, replaced);
    n.insert(tree::Path{key}, std::move(sub));
  };
  cls.def("__setattr__", set_child);
  cls.def("__setitem__", [set_child](PyTree& self, py::handle key, py::handle value) {
    if (PyUnicode_Check(key.ptr())) return set_child(self, key.cast<std::string>(), value);
    // Leaf-wise assignment leaf[key] = value; a tree key (a mask, DI-treetensor's
    // t[t > 0] = 0) or value is zipped by path, its leaf facing a subtree broadcast into it
    // (treevalue's inherit), anything else broadcast. A leaf's error names its path and the
    // leaves assigned before it (as the per-leaf loop leaves them, and as in-place ops say).
    const TensorTree& n = self.node();
    const RootUse use(*self.root);  // torch's __setitem__ may run Python code: the keys stay
    const auto flat = tree::flatten_refs(n);
    const auto paths = flat.spec.paths();
    auto leaf_of = [&](py::handle tree_or_value, std::size_t i) -> py::object {
      if (!is_tree(tree_or_value)) return py::reinterpret_borrow<py::object>(tree_or_value);
      const TensorTree& root = as_tree(tree_or_value).node();
      const tree::Path& p = paths[i];
      for (std::size_t d = p.size() + 1; d-- > 0;) {  // the leaf at p, or at a prefix of p
        const TensorTree* c = root.find(
            d == p.size() ? p : tree::Path(std::vector<std::string>(p.begin(), p.begin() + d)));
        if (c == nullptr) continue;
        if (c->is_leaf()) return wrap_tensor(c->leaf());
        break;  // a subtree, without p
      }
      throw py::key_error("treetensor: __setitem__: the tree index or value has no leaf at '" +
                          p.describe() + "'");
    };
    for (std::size_t i = 0; i < paths.size(); ++i) {
      py::object k = leaf_of(key, i), v = leaf_of(value, i);
      try {
        wrap_tensor(*flat.leaves[i])[k] = v;
      } catch (py::error_already_set& e) {
        std::string assigned;  // the first 8 paths
        for (std::size_t j = 0; j < std::min<std::size_t>(i, 8); ++j)
          assigned += (j ? ", '" : " '") + paths[j].str() + "'";
        if (i > 8) assigned += ", ...";
        reraise(e.value(), "__setitem__ at leaf '" + paths[i].describe() +
                               "': " + py::str(e.value()).cast<std::string>() + " (assigned " +
                               std::to_string(i) + " of " + std::to_string(paths.size()) +
                               " leaves before it" + (i ? ":" + assigned : "") + ")");
      }
    }
  });
  // A missing key: KeyError for del t[k], AttributeError for del t.k (as Python's and
  // DI-treetensor's, so `except AttributeError` around `del t.k` catches it).
  auto del_child = [](PyTree& self, const std::string& key, bool attribute) {
    TensorTree& n = self.node_mut();
    const TensorTree removed = outlive_change(n, key);
    if (self.root->views && !n.is_leaf() && n.find_child(key))
      detach_views(*self.root, self.path / key, removed);
    if (n.is_leaf() || !n.erase(tree::Path{key})) {
      const std::string what = "treetensor: no key '" + key + "' at '" + self.path.describe() + "'";
      if (attribute) throw py::attribute_error(what);
      throw py::key_error(what);
    }
  };
  cls.def("__delattr__",
          [del_child](PyTree& self, const std::string& key) { del_child(self, key, true); });
  cls.def("__delitem__",
          [del_child](PyTree& self, const std::string& key) { del_child(self, key, false); });
  cls.def("__contains__", [](const PyTree& self, const std::string& key) {
    const TensorTree& n = self.node();
    return !n.is_leaf() && n.find(tree::Path{key}) != nullptr;
  });
  cls.def("__len__", [](const PyTree& self) { return self.node().size(); });
  cls.def(
      "_constraint",
      [](const PyTree& self) { return self.constraint ? self.constraint : py::none(); },
      "This object's constraint (treetensor/_constraint.py), None when it has none.");
  cls.def(
      "_with_constraint",
      [](const PyTree& self, py::object c) {
        return PyTree{self.root, self.path, c.is_none() ? py::object() : std::move(c)};
      },
      "A new object over the same node with constraint c (None: none).");
  cls.def(
      "_node_id", [](const PyTree& self) { return reinterpret_cast<std::uintptr_t>(&self.node()); },
      "The address of this node in its root tree: the same for every view of the node while "
      "the tree's keys do not change (graph()'s node ids).");
  cls.def(
      "keys",
      [](const PyTree& self) {
        const py::tuple keys = key_strs(self, self.node());
        PyObject* list = PySequence_List(keys.ptr());
        if (!list) throw py::error_already_set();
        return py::reinterpret_steal<py::list>(list);
      },
      "The keys of this node, sorted (a list).");
  cls.def(
      "values",
      [](const PyTree& self) {
        const TensorTree& n = self.node();
        const RootUse use(*self.root);  // allocations may run Python: the keys stay
        py::list out;
        for (const auto& [k, v] : n) out.append(child_object(self, v, k));
        return out;
      },
      "The children of this node in key order: tensors for leaves, trees for subtrees.");
  cls.def(
      "items",
      [](const PyTree& self) {
        const TensorTree& n = self.node();
        const RootUse use(*self.root);  // allocations may run Python: the keys stay
        const py::tuple keys = key_strs(self, n);
        py::list out(keys.size());
        Py_ssize_t i = 0;
        for (const auto& [k, v] : n) {
          PyObject* pair = PyTuple_New(2);
          if (!pair) throw py::error_already_set();
          PyObject* key = PyTuple_GET_ITEM(keys.ptr(), i);
          Py_INCREF(key);
          PyTuple_SET_ITEM(pair, 0, key);
          PyList_SET_ITEM(out.ptr(), i++, pair);  // owned by out before the next call can throw
          PyTuple_SET_ITEM(pair, 1, child_object(self, v, k).release().ptr());
        }
        return out;
      },
      "(key, child) pairs in key order.");
  // The keys, not through t.keys (a key 'keys' comes before the method).
  cls.def("__iter__", [](const PyTree& self) { return py::iter(key_strs(self, self.node())); });
  // The keys backwards (DI-treetensor's); without it Python would index the leaves by ints.
  cls.def("__reversed__", [](const PyTree& self) {
    py::list keys(key_strs(self, self.node()));
    if (PyList_Reverse(keys.ptr()) != 0) throw py::error_already_set();
    return py::iter(keys);
  });
  // numpy must not take a tree for a sequence of its keys (np.asarray(t) would be the keys'
  // names), and defers to the tree's reflected operators (np.float32(2) * t, array + t).
  cls.def("__array__", [](const PyTree& self, py::args, py::kwargs) -> py::object {
    throw_type("treetensor: a tree of " + std::to_string(self.node().leaf_count()) +
               " leaves is not one numpy array: convert a leaf (t.a.numpy()), or use "
               "t.numpy() for a tree of arrays");
  });
  cls.attr("__array_ufunc__") = py::none();
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
  cls.def(
      "apply",
      [](py::handle self, const py::function& fn, const py::args& args, const py::kwargs& kwargs) {
        // Bound here rather than as a Python lambda over ttorch.apply: one call frame less
        // (0.7 us of a 3-leaf call).
        py::tuple all(args.size() + 1);
        all[0] = self;
        for (std::size_t i = 0; i < args.size(); ++i) all[i + 1] = args[i];
        return apply_leafwise(fn, py::reinterpret_borrow<py::args>(all), kwargs);
      },
      py::arg("fn"),
      "ttorch.apply(fn, self, *args, **kwargs): fn on every leaf of this tree (and of the other "
      "tree arguments, zipped strictly), through the runtime.");
  cls.def("_leaf_call", &leaf_call, py::arg("fn"), py::arg("args"), py::arg("kwargs"),
          py::arg("op"),
          "fn(leaf, *args, **kwargs) on every leaf, with the GIL held: a tree when every result "
          "is a tensor, else the nested dict of the results (treetensor.torch's fallback).");
  cls.def_property_readonly("_path", [](const PyTree& self) { return self.path.str(); });
  cls.def("_same_root",
          [](const PyTree& self, const PyTree& other) { return self.root == other.root; });

  // pickle / copy / deepcopy: treetensor.torch's __reduce__ (a builder function and the nested
  // dict of tensors; never cls.__new__ and a state, which leaves an object unmade until then).

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
      "_set_attr_fallback",
      [](py::object fn, py::dict methods) {
        Py_XDECREF(g_attr_fallback);
        Py_XDECREF(g_attr_methods);
        g_attr_fallback = fn.release().ptr();
        g_attr_methods = methods.release().ptr();
      },
      py::arg("fn"), py::arg("methods"),
      "Installs fn(tree, name) -> value or None, asked by Tensor.__getattr__ for a name that is "
      "neither a key nor a method and not in `methods` (name -> function, bound to the tree "
      "there); treetensor.torch's fallback to torch.");
  m.def(
      "from_dict", [](py::handle d) { return wrap(to_tree(d)); }, py::arg("data"),
      "A tree from a nested dict (torch.Tensor leaves are shared).");
  m.def(
      "to_dict", [](py::handle t) { return to_dict(to_tree(t)); }, py::arg("tree"));

  bind_ops(m, cls);
  bind_runtime(m);
  bind_pending(m);
  bind_io(m);
  bind_structure(m);
  bind_optim(m);
}
