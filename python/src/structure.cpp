// treetensor.torch.tree_flatten / tree_unflatten and TreeSpec (DESIGN.md §1, §15): the tree
// layer's flatten over Python trees, with optree's calling (leaves and a reusable structure,
// unflatten(spec, leaves)), so a structure is taken apart and rebuilt without a Python walk.
#include <algorithm>
#include <cstddef>
#include <iterator>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common.hpp"
#include "treetensor/tree/flatten.hpp"

namespace treetensor::python {
namespace {

using tree::TreeSpec;

// "a float", "an int", "an Object": the type of `v` (its qualified name when it is no builtin)
// with its article, for messages.
std::string article(py::handle v) {
  const py::handle type = reinterpret_cast<PyObject*>(Py_TYPE(v.ptr()));
  const std::string module = py::str(type.attr("__module__"));
  const std::string name = (module == "builtins" ? "" : module + ".") +
                           py::str(type.attr("__qualname__")).cast<std::string>();
  return (std::string("aeiouAEIOU").find(name.front()) != std::string::npos ? "an " : "a ") + name;
}

// The leaf paths as tuples of str. Consecutive paths in flatten order share the keys of their
// common ancestors, so each node's key becomes one str, shared by the tuples below it: a
// 19-deep chain makes 19 strs where a str per path element made 190 (peers: keys() of the
// nested 19 leaves).
py::list spec_paths(const TreeSpec& spec) {
  const std::vector<tree::Path> paths = spec.paths();
  py::list out(paths.size());
  std::vector<py::object> keys;  // the previous path's strs
  const tree::Path* prev = nullptr;
  for (std::size_t i = 0; i < paths.size(); ++i) {
    const tree::Path& p = paths[i];
    std::size_t shared = 0;
    while (prev && shared < p.size() && shared < prev->size() && p[shared] == (*prev)[shared])
      ++shared;
    keys.resize(shared);
    for (std::size_t k = shared; k < p.size(); ++k) keys.emplace_back(py::str(p[k]));
    PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(p.size()));
    if (!t) throw py::error_already_set();
    for (std::size_t k = 0; k < p.size(); ++k)
      PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(k), keys[k].inc_ref().ptr());
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), t);
    prev = &p;
  }
  return out;
}

std::string spec_repr(const TreeSpec& spec) {
  constexpr std::size_t kShown = 8;  // a 5,000-leaf spec's repr stays one line
  const auto paths = spec.paths();
  std::string text = "TreeSpec(" + std::to_string(spec.leaf_count()) + " leaves: ";
  for (std::size_t i = 0; i < paths.size() && i < kShown; ++i)
    text += (i ? ", " : "") + paths[i].describe();
  if (paths.size() > kShown) text += ", ...";
  return text + ")";
}

// The leaves of n in flatten order (sorted keys, depth first; iterative: any depth). The caller
// holds the root (RootUse): wrapping a tensor allocates, which may run Python.
py::list leaves_of(const TensorTree& n) {
  py::list out;
  std::vector<const TensorTree*> stack{&n};
  while (!stack.empty()) {
    const TensorTree* node = stack.back();
    stack.pop_back();
    if (node->is_leaf()) {
      if (PyList_Append(out.ptr(), wrap_tensor(node->leaf()).ptr()) != 0)
        throw py::error_already_set();
      continue;
    }
    const auto& children = node->children();
    for (auto it = children.rbegin(); it != children.rend(); ++it) stack.push_back(&it->second);
  }
  return out;
}

// The Python TreeSpec: the tree layer's spec and its paths() as Python tuples, made at the
// first paths() call and shared by later ones (the spec is immutable, so they never change).
struct PySpec {
  TreeSpec spec;
  mutable py::object paths;  // a tuple of path tuples, or null
};

// A nested dict given to tree_flatten: each leaf must already be a tensor (the leaves come back
// as the same objects, and tree_unflatten takes tensors only). Iterative, each dict once (a
// dict met again is to_tree's to report, with both paths).
void require_tensor_leaves(py::handle dict) {
  std::vector<std::pair<py::handle, std::string>> todo{{dict, ""}};
  std::unordered_set<PyObject*> seen;
  std::vector<py::object> kept;  // the dicts of TreeValues met, alive while todo holds them
  while (!todo.empty()) {
    const auto [node, path] = todo.back();
    todo.pop_back();
    if (!seen.insert(node.ptr()).second) continue;
    for (const auto& [k, v] : py::reinterpret_borrow<py::dict>(node)) {
      const std::string at = (path.empty() ? "" : path + ".") + py::str(k).cast<std::string>();
      if (PyDict_Check(v.ptr())) {
        todo.emplace_back(v, at);
      } else if (is_tensor(v) || is_tree(v)) {  // a tree's leaves are tensors
        continue;
      } else if (py::object d = foreign_dict(v); !d.is_none()) {
        kept.push_back(d);
        todo.emplace_back(d, at);
      } else {
        throw py::type_error("tree_flatten: leaf '" + at + "' is " + article(v) + ", not a " +
                             "torch.Tensor (ttorch.tensor(d) makes a tree of tensors from other "
                             "values)");
      }
    }
  }
}

// The spec object is made once per node while the root's keys stay (Root::cache), so
// flattening an unchanged tree again walks only its leaves and reuses the spec's paths().
py::tuple flatten_tree(py::handle h) {
  if (!is_tree(h)) {  // a nested dict or a TreeValue, as torch.utils._pytree takes them
    const py::object dict =
        py::isinstance<py::dict>(h) ? py::reinterpret_borrow<py::object>(h) : foreign_dict(h);
    if (dict.is_none())
      throw py::type_error(std::string("tree_flatten: expected a treetensor tree, a nested dict "
                                       "of tensors or a treevalue TreeValue, got ") +
                           Py_TYPE(h.ptr())->tp_name);
    require_tensor_leaves(dict);
    const py::object tree = wrap(to_tree(dict));
    return flatten_tree(tree);
  }
  const PyTree& t = as_tree(h);
  const TensorTree& n = t.node();
  const RootUse use(*t.root);
  py::object spec = t.root->cache(n).spec;
  if (!spec) {
    spec = py::cast(PySpec{tree::flatten_refs(n).spec, {}});
    t.root->cache(n).spec = spec;  // looked up again: making the object may run Python
  }
  return py::make_tuple(leaves_of(n), spec);
}

py::list paths_of(const PySpec& s) {
  if (!s.paths) s.paths = py::tuple(spec_paths(s.spec));
  PyObject* out = PySequence_List(s.paths.ptr());
  if (!out) throw py::error_already_set();
  return py::reinterpret_steal<py::list>(out);
}

// The tensors of a list or tuple's items, read in order as tree::unflatten reads its leaves
// (each item already checked to be a tensor).
class TensorItems {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = at::Tensor;
  using difference_type = std::ptrdiff_t;
  using reference = at::Tensor;

  TensorItems() = default;
  explicit TensorItems(PyObject* const* item) : item_(item) {}
  at::Tensor operator*() const { return unpack_tensor(*item_); }
  TensorItems& operator++() {
    ++item_;
    return *this;
  }
  TensorItems operator++(int) {
    TensorItems before = *this;
    ++item_;
    return before;
  }

 private:
  PyObject* const* item_ = nullptr;
};

// A tuple of `n` owned items: items[0..n) of a list as they are now, or seq[0..n) of any other
// sequence read by index (its own __getitem__, which may run any Python code).
py::tuple own_items(py::handle seq, std::size_t n) {
  py::tuple out(n);
  const bool list = PyList_CheckExact(seq.ptr());
  for (std::size_t i = 0; i < n; ++i) {
    const auto at = static_cast<Py_ssize_t>(i);
    PyObject* item =
        list ? Py_NewRef(PyList_GET_ITEM(seq.ptr(), at)) : PySequence_GetItem(seq.ptr(), at);
    if (!item) throw py::error_already_set();
    PyTuple_SET_ITEM(out.ptr(), at, item);
  }
  return out;
}

// A tensor by type alone (torch.Tensor or a subclass): runs no Python code, unlike
// isinstance, so borrowed items stay valid across the check.
bool tensor_by_type(PyObject* o) {
  return THPVariable_CheckExact(o) ||
         PyType_IsSubtype(Py_TYPE(o), reinterpret_cast<PyTypeObject*>(THPVariableClass));
}

// Every leaf must be a torch.Tensor: the error names its index and the spec's path for it.
// The leaves go from the items straight into the tree (no vector of them first: at thousands
// of leaves its one large block made glibc merge its freed small blocks every call). The
// items are borrowed from a plain list or tuple, so nothing between reading and using them
// may run Python code or release the GIL; with a pending leaf (waiting for it releases the
// GIL, when another thread may change a list) or another kind of sequence, they are read
// into a tuple of their own first.
py::object unflatten_tree(const PySpec& py_spec, const py::sequence& leaves) {
  const TreeSpec& spec = py_spec.spec;
  const std::size_t n = py::len(leaves);
  if (n != spec.leaf_count())
    throw py::value_error("tree_unflatten: the spec has " + std::to_string(spec.leaf_count()) +
                          " leaves but " + std::to_string(n) + " were given");
  const bool list = PyList_CheckExact(leaves.ptr());
  py::object items = leaves;
  if (!list && !PyTuple_CheckExact(leaves.ptr())) items = own_items(leaves, n);
  PyObject* const* first = PySequence_Fast_ITEMS(items.ptr());
  if (list && std::any_of(first, first + n, is_pending_tensor)) {
    items = own_items(leaves, n);
    first = PySequence_Fast_ITEMS(items.ptr());
  }
  for (std::size_t i = 0; i < n; ++i)
    if (!tensor_by_type(first[i])) {
      const auto leaf = py::reinterpret_borrow<py::object>(first[i]);
      throw py::type_error("tree_unflatten: leaf " + std::to_string(i) + " (at '" +
                           spec.paths()[i].describe() + "') is " + article(leaf) +
                           ", not a torch.Tensor");
    }
  return wrap(TreeTensor(tree::unflatten<at::Tensor>(spec, TensorItems(first))));
}

}  // namespace

void bind_structure(py::module_& m) {
  py::class_<PySpec>(m, "TreeSpec", R"(The structure of a tree without its leaves (keys at
their places): what tree_unflatten needs to rebuild it. Immutable and cheap to keep; two specs
are equal when their trees have the same keys at the same places (hashable, consistent with ==).)")
      .def_property_readonly(
          "num_leaves", [](const PySpec& s) { return s.spec.leaf_count(); },
          "The number of leaves.")
      .def_property_readonly(
          "num_nodes", [](const PySpec& s) { return s.spec.node_count(); },
          "The number of nodes, leaves and the root included.")
      .def("paths", &paths_of,
           "The leaf paths in flatten order (sorted keys, depth first): tuples of keys (a new "
           "list each call).")
      .def("__eq__",
           [](const PySpec& a, py::handle b) {
             return py::isinstance<PySpec>(b) && a.spec == b.cast<const PySpec&>().spec;
           })
      .def("__hash__", [](const PySpec& s) { return s.spec.hash(); })
      .def("__repr__", [](const PySpec& s) { return spec_repr(s.spec); });
  m.def("tree_flatten", &flatten_tree, py::arg("tree"),
        R"(tree_flatten(tree) -> (leaves, spec): the leaf tensors in flatten order (sorted keys,
depth first; the same tensor objects) and the tree's TreeSpec (optree's and
torch.utils._pytree's calling). A consolidated tree's leaves are its views. A nested dict of
tensors or a treevalue TreeValue of them is read as the tree it makes; anything else, or a leaf
that is not a tensor, is a TypeError (naming the leaf's path).)");
  m.def("tree_unflatten", &unflatten_tree, py::arg("spec"), py::arg("leaves"),
        R"(tree_unflatten(spec, leaves) -> tree: the tree of spec's structure holding `leaves`
(torch.Tensor, in flatten order; the same objects). Raises ValueError when their number is not
spec.num_leaves, TypeError naming the index and path of a leaf that is not a tensor.)");
}

}  // namespace treetensor::python
