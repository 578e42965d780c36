#pragma once
// The Python wing's shared pieces (DESIGN.md §15): the bound tree object, conversions between
// Python values and trees, tensors, scalars and options, and the GIL-releasing call helper.
// Only this wing knows Python; the layers below never include it.

// clang-format off
#include <torch/csrc/python_headers.h>  // Python.h first
// clang-format on
#include <pybind11/pybind11.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "treetensor/treetensor.hpp"

namespace treetensor::python {
/// A Python number (bool, int, float) or 0-d tensor taken as an at::Scalar argument. Bindings
/// take this, not at::Scalar: torch 2.x's pybind.h has its own caster for at::Scalar, which
/// converts to Python only (loading one is "NYI" there).
struct Number {
  at::Scalar value;
  operator const at::Scalar&() const { return value; }  // NOLINT: passed where ATen takes one
};
/// Whether `o` is exactly a treetensor.asyncs.PendingTensor. No Python call.
bool is_pending_tensor(PyObject* o) noexcept;
/// The plain tensor a PendingTensor stands for (a wrapper without storage), once its job has
/// run (waited for with the GIL released); raises the job's error. Needs the GIL.
pybind11::object pending_result(pybind11::handle tensor);
/// A numpy scalar (np.float32(2), np.int64(3), np.bool_(True): an instance of numpy.generic)
/// as the Python number its item() gives, torch's reading of one; else a null object. No
/// Python call unless numpy is imported.
pybind11::object numpy_scalar_item(pybind11::handle h);
/// Whether `h` is a numpy.ndarray (a tensor operand to torch: torch.as_tensor of it).
bool is_ndarray(pybind11::handle h);
/// An optional Number as the std::optional<at::Scalar> ATen-style functions take.
inline std::optional<at::Scalar> scalar(const std::optional<Number>& n) {
  if (!n) return std::nullopt;
  return n->value;
}
}  // namespace treetensor::python

namespace pybind11::detail {
template <>
struct type_caster<treetensor::python::Number> {
  PYBIND11_TYPE_CASTER(treetensor::python::Number, const_name("number"));
  bool load(handle src, bool) {
    PyObject* o = src.ptr();
    if (PyBool_Check(o)) {
      value.value = c10::Scalar(o == Py_True);
    } else if (PyLong_Check(o)) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow) return false;
      value.value = c10::Scalar(static_cast<int64_t>(v));
    } else if (PyFloat_Check(o)) {
      value.value = c10::Scalar(PyFloat_AS_DOUBLE(o));
    } else if (PyComplex_Check(o)) {  // as torch: full(shapes, 1j), fill_(1j)
      value.value =
          c10::Scalar(c10::complex<double>(PyComplex_RealAsDouble(o), PyComplex_ImagAsDouble(o)));
    } else if (treetensor::python::is_pending_tensor(o)) {  // a 0-d result: waited for
      value.value = THPVariable_Unpack(treetensor::python::pending_result(src).ptr()).item();
    } else if (THPVariable_Check(o) && THPVariable_Unpack(o).dim() == 0) {
      value.value = THPVariable_Unpack(o).item();
    } else if (object v = treetensor::python::numpy_scalar_item(src)) {
      return !treetensor::python::numpy_scalar_item(v) && load(v, false);
    } else {
      return false;
    }
    return true;
  }
  static handle cast(const treetensor::python::Number& n, return_value_policy, handle) {
    const c10::Scalar& s = n.value;
    if (s.isBoolean()) return PyBool_FromLong(s.toBool());
    if (s.isIntegral(false)) return PyLong_FromLongLong(s.toLong());
    if (s.isComplex()) {
      const auto z = s.toComplexDouble();
      return PyComplex_FromDoubles(z.real(), z.imag());
    }
    return PyFloat_FromDouble(s.toDouble());
  }
};
}  // namespace pybind11::detail

namespace treetensor::python {

namespace py = pybind11;

/// The tree a Python tree object and its views share, with the count of GIL-released tree
/// calls (nogil) that hold references into it. Its keys may change only while that count is 0:
/// otherwise a call reading it on a lane, or a callback of such a call, would see nodes freed
/// under it.
struct PyTree;
struct Root : TreeTensor {
  explicit Root(TreeTensor t) : TreeTensor(std::move(t)) {}
  std::atomic<int> users{0};
  /// The first of the Python views of this root (objects with a non-empty path, linked
  /// through PyTree), for detach_views. Touched with the GIL held.
  PyTree* views = nullptr;
  // Bumped by every change of keys (with the GIL held): a pin noted before a change belongs
  // to an access that made no call (see CallPins).
  std::uint64_t version = 0;
  /// What listing a node makes that depends only on its keys, kept while they stay.
  struct NodeCache {
    py::object keys;  // keys()/items()' str objects, a tuple in key order (null: not made yet)
    py::object spec;  // tree_flatten's TreeSpec of the node (null: not made yet)
  };
  /// The node caches, valid while cache_version == version (cleared at the first use after a
  /// change of keys). Touched with the GIL held, and a Root is destroyed with it held (Python
  /// objects and CallPins own Roots).
  NodeCache& cache(const TensorTree& node) {
    if (cache_version != version) {
      node_caches.clear();
      cache_version = version;
    }
    return node_caches[&node];
  }

 private:
  std::unordered_map<const TensorTree*, NodeCache> node_caches;
  std::uint64_t cache_version = 0;
};

/// Most roots one call pins: node() calls not followed by a tree call (keys(), attribute
/// access) must not grow the list; a call passes nodes of a few trees (more are copied).
constexpr std::size_t kMaxPins = 16;

/// Counts the calling code as a user of `root` while it lives: begin_change refuses changes of
/// its keys meanwhile, so references into the tree stay valid across a GIL release or Python
/// code (a constraint's callback, a garbage collector's finalizer).
class RootUse {
 public:
  explicit RootUse(Root& r) : r_(r) { r_.users.fetch_add(1, std::memory_order_relaxed); }
  ~RootUse() { r_.users.fetch_sub(1, std::memory_order_relaxed); }
  RootUse(const RootUse&) = delete;
  RootUse& operator=(const RootUse&) = delete;

 private:
  Root& r_;
};

/// The same for the roots the calling thread's next nogil() will read (pin_next_call): a tree
/// call that waits (GIL released) while converting its arguments, after its operands' nodes
/// were handed out, keeps those nodes.
class NextCallRootsUse {
 public:
  NextCallRootsUse();
  ~NextCallRootsUse();
  NextCallRootsUse(const NextCallRootsUse&) = delete;
  NextCallRootsUse& operator=(const NextCallRootsUse&) = delete;

 private:
  std::array<std::shared_ptr<Root>, kMaxPins> roots_;
  std::size_t count_ = 0;
};

/// Notes that the calling thread's next nogil() reads `root` (see nogil).
void pin_next_call(const std::shared_ptr<Root>& root);
/// Before a change of `root`'s keys: bumps its version.
/// @throws RuntimeError when a GIL-released call is reading `root` (from a callback of that
///         call or from another Python thread).
void begin_change(Root& root, const tree::Path& where);

/// Waits with the GIL released until `done_within(slice)` says the awaited work is done,
/// running Python's signal handlers between slices of 50 ms (on the main thread: Python runs
/// them nowhere else), so that Ctrl-C raises KeyboardInterrupt here (the work goes on; a later
/// read waits again). Returns at once, for the caller's own blocking wait (with its usage
/// checks and watchdog) to follow, inside an asyncs job, and once the asyncs watchdog's
/// timeout has passed. Needs the GIL.
/// @throws py::error_already_set: what a signal handler raised.
void wait_interruptibly(const std::function<bool(std::chrono::milliseconds)>& done_within);

/// The object behind `treetensor.torch.Tensor`: a node of a shared root tree. A root has an
/// empty path; `t.a` is a view (the same root, path "a"), so `t.a.b = x` and in-place ops on
/// `t.a` change `t`. The node is looked up at each use; when its key (or one above it) is
/// replaced or deleted, the view keeps the node it was taken from (detach_views).
/// Made, copied and destroyed with the GIL held (it links itself into its root's views).
struct PyTree {
  PyTree(std::shared_ptr<Root> r, tree::Path p, py::object c)
      : root(std::move(r)), path(std::move(p)), constraint(std::move(c)) {
    link();
  }
  PyTree(const PyTree& o) : PyTree(o.root, o.path, o.constraint) {}
  PyTree(PyTree&& o) noexcept
      : root(o.root), path(std::move(o.path)), constraint(std::move(o.constraint)) {
    o.unlink();
    link();
  }
  PyTree& operator=(const PyTree&) = delete;
  PyTree& operator=(PyTree&&) = delete;
  ~PyTree() { unlink(); }

  std::shared_ptr<Root> root;
  tree::Path path;
  /// treevalue's constraint of this object (treetensor/_constraint.py), or null: it belongs to
  /// the object, not the tree (with_constraints gives a new object over the same root), and a
  /// child view gets the part for its key. Touched with the GIL held only.
  py::object constraint;

  /// Moves this view onto another root and path (detach_views).
  void rebase(std::shared_ptr<Root> r, tree::Path p) {
    unlink();
    root = std::move(r);
    path = std::move(p);
    link();
  }
  PyTree* next_view() const { return next_; }

  // Reads go through the const tree: a mutable access would drop a consolidated root's
  // property (consolidate.hpp). The reference may be handed to the next nogil() call, which
  // keeps the root's keys unchanged while it runs.
  /// The node for a read: a pending tree (an asyncs pending result, DESIGN.md §10) is waited
  /// for first, with the GIL released; its job's error is raised here.
  const TensorTree& node() const {
    const TensorTree& n = operand();
    wait_ready(n);
    return n;
  }
  /// The node as an operand of a tree call: a pending node is passed on as it is, so that a
  /// call inside a pending scope chains on it without waiting (the root is waited for when
  /// the path goes below it).
  const TensorTree& operand() const {
    pin_next_call(root);
    const TreeTensor& r = *root;
    if (path.empty()) return r;
    wait_ready(r);
    return r.at(path);
  }
  /// Makes `n` (a node of this root), when pending, with the GIL released; the root counts a
  /// user meanwhile, so that no other Python thread changes its keys under the wait.
  void wait_ready(const TensorTree& n) const {
    if (!n.is_pending()) return;
    const RootUse use(*root);
    if (const auto* source = n.pending_source())
      wait_interruptibly([source](auto slice) { return source->wait_for(slice); });
    py::gil_scoped_release release;
    (void)n.is_leaf();
  }
  /// For changes of keys. @throws RuntimeError while a tree call reads this root.
  TensorTree& node_mut() {
    wait_ready(*root);
    begin_change(*root, path);
    return path.empty() ? *root : root->at(path);
  }
  /// Replaces the node by `t`, which has its keys (a copy left pending by an in-place call
  /// inside a pending scope): a pending root is not waited for. @throws as node_mut().
  void replace(TensorTree t) {
    if (!path.empty()) {
      const TensorTree old = std::exchange(node_mut(), std::move(t));
      return;
    }
    begin_change(*root, path);
    // The old root dies after the change (see outlive_change in module.cpp).
    const TensorTree old = std::exchange(static_cast<TensorTree&>(*root), std::move(t));
  }

 private:
  void link() {
    if (path.empty()) return;
    next_ = root->views;
    if (next_) next_->prev_ = this;
    root->views = this;
    linked_ = true;
  }
  void unlink() {
    if (!linked_) return;
    (prev_ ? prev_->next_ : root->views) = next_;
    if (next_) next_->prev_ = prev_;
    prev_ = next_ = nullptr;
    linked_ = false;
  }
  PyTree* prev_ = nullptr;
  PyTree* next_ = nullptr;
  bool linked_ = false;
};

/// torch.Tensor.<name> over the leaves of tree object `self` in Python (the package's fallback
/// to torch, DI-treetensor parity), tree arguments zipped (an Object of shapes, a tensor bound):
/// for arguments a bound method's own signature does not take. Needs the GIL.
py::object torch_leafwise(py::handle self, const char* name, const py::args& args,
                          const py::kwargs& kwargs = {});

/// Before the child at `changed` of `root` is replaced or deleted (its copy `old`): every
/// view at or below it moves onto one new root holding `old` (its tensors shared), so that a
/// view keeps the node it was taken from (treevalue's, DI-treetensor parity: `prev = t.h;
/// t.h = prev * 2` leaves `prev` as it was; `t.x, t.y = t.y, t.x` swaps). Needs the GIL.
void detach_views(Root& root, const tree::Path& changed, const TensorTree& old);

/// The Python type of PyTree (set by the module init).
PyTypeObject* tree_type();
inline bool is_tree(py::handle h) {
  return PyObject_TypeCheck(h.ptr(), tree_type()) != 0;
}
inline PyTree& as_tree(py::handle h) {
  return h.cast<PyTree&>();
}
inline bool is_tensor(py::handle h) {
  return THPVariable_CheckExact(h.ptr()) || THPVariable_Check(h.ptr());
}

/// The dicts open on one walk over nested Python dicts (a tree, a shape tree), for its errors:
/// the tree layer's copies, map and zip recurse once per level and are sized for 10,000
/// levels (tree/core.hpp), and a dict that contains itself would be walked for ever.
class OpenDicts {
 public:
  static constexpr std::size_t kMaxDepth = 10000;
  /// Enters dict `h`, met at path `where` (its depth: where.size()).
  /// @throws ValueError when `h` is already open (a cycle, naming both paths) or `where` is
  ///         kMaxDepth levels deep.
  void enter(py::handle h, const tree::Path& where);
  void leave(py::handle h) { open_.erase(h.ptr()); }

 private:
  std::unordered_map<PyObject*, std::size_t> open_;  // dict -> its depth on the path
};

/// A new Python tree object owning `t`; a leaf root (a single tensor) becomes a torch.Tensor.
py::object wrap(TreeTensor t);
/// A tensor as its Python object: the same torch.Tensor object when one exists (PyObject
/// preservation), None for an undefined tensor.
inline py::object wrap_tensor(const at::Tensor& t) {
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
}
/// A tree from a Python value: a tree object (its node, shared tensors), a nested dict with
/// string keys (torch.Tensor leaves are shared, other leaves go through torch.as_tensor).
/// @throws TypeError naming the path of a key that is not a string.
TreeTensor to_tree(py::handle h, const tree::Path& at = {});
/// Whether `h` is a treevalue TreeValue (DI-treetensor's trees, read where a dict is taken). A
/// sys.modules lookup when treevalue was never imported, else a Python call: ask only where a
/// dict, tree, tensor and number have been ruled out.
bool is_foreign_tree(py::handle h);
/// The nested dict of a treevalue TreeValue (treetensor.common._foreign_dict), or None; as
/// is_foreign_tree costs.
py::object foreign_dict(py::handle h);
/// A nested dict of torch.Tensor from a tree (the same Python tensor objects).
py::object to_dict(const TensorTree& t);
/// treetensor.common.Object, looked up once and kept for the process. Needs the GIL.
py::handle object_class();

/// The operands of one call, keeping alive what the Operands borrow.
class Args {
 public:
  Operand add(py::handle h);
  std::vector<Operand>& ops() { return ops_; }
  bool any_tree() const { return any_tree_; }

 private:
  std::deque<at::Tensor> tensors_;
  std::deque<TreeTensor> trees_;
  std::vector<Operand> ops_;
  bool any_tree_ = false;
};
/// One operand (not recorded in an Args' list): a tree, a tensor or a Python number.
/// @throws TypeError for anything else.
Operand operand(py::handle h, Args& keep);

/// at::TensorOptions from the Python dtype / device keywords (None: unset).
at::TensorOptions options(py::handle dtype, py::handle device);
at::ScalarType to_dtype(py::handle dtype);
at::Device to_device(py::handle device);

/// The roots the calling thread's PyTree::node() calls named since its last nogil(), counted
/// as users while the call runs (decremented with the GIL held again). No allocation: this is
/// on every tree call's path.
class CallPins {
 public:
  CallPins();
  ~CallPins();
  CallPins(const CallPins&) = delete;
  CallPins& operator=(const CallPins&) = delete;

 private:
  std::array<std::shared_ptr<Root>, kMaxPins> roots_;
  std::size_t count_ = 0;
};

/// The c10 warnings a tree call raises (on the calling thread, and on its lanes, which the
/// runtime forwards to it), made Python warnings when the call is done, as torch's bindings
/// make theirs (torch::PyWarningHandler): `warnings` filters, -W error and pytest.warns see
/// them. Made and destroyed with the GIL held, around the GIL-released call.
class PythonWarnings {
 public:
  PythonWarnings() : previous_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(&caught_);
  }
  /// Issues the caught warnings (UserWarning or DeprecationWarning, as torch's).
  /// @throws py::error_already_set when a filter makes one an error, unless an exception is
  ///         already leaving the call (it then wins, as torch's handler does).
  ~PythonWarnings() noexcept(false);
  PythonWarnings(const PythonWarnings&) = delete;
  PythonWarnings& operator=(const PythonWarnings&) = delete;

 private:
  // c10's handler interface has a noexcept destructor; the issuing one above may throw.
  struct Caught final : c10::WarningHandler {
    void process(const c10::Warning& warning) override {
      const std::lock_guard lock(m);
      warnings.push_back(warning);
    }
    std::mutex m;  // the runtime's lanes forward one at a time; any other thread may too
    std::vector<c10::Warning> warnings;
  };
  c10::WarningHandler* const previous_;
  const int unwinding_ = std::uncaught_exceptions();
  Caught caught_;
};

/// Runs f with the GIL released (every tree call doing leaf work goes through this). The trees
/// whose nodes the call was given keep their keys meanwhile (Root::users); its c10 warnings
/// become Python warnings after it.
template <class F>
decltype(auto) nogil(F&& f) {
  // Warnings are issued last, once the pins are dropped: a warnings hook is Python code that
  // may change the trees' keys.
  const PythonWarnings warnings;
  const CallPins pins;
  py::gil_scoped_release release;
  return f();
}

/// Raises exc's type with `message` (op and leaf path), chained to exc; exceptions that are not
/// Exceptions (KeyboardInterrupt, SystemExit) and types not constructible from a string are
/// raised unchanged. Needs the GIL.
[[noreturn]] void reraise(py::object exc, const std::string& message);

/// A tree-level reduction (reduce.hpp), which goes pending inside a pending asyncs scope.
using TreeLevelFn = std::function<at::Tensor(const TensorTree&)>;
/// f(n), a tree-level reduction (one tensor). Inside a pending asyncs scope (DESIGN.md §10) it
/// is queued on the scope's thread and the result is a treetensor.asyncs.PendingTensor standing
/// for a preallocated 0-d tensor the job writes, which waits for the job on every read; a
/// pending operand is waited for first (its dtypes decide the result's), and a call autograd
/// records (or of quantized leaves) is made as outside a pending scope: a blocking call on the
/// scope's thread. Needs the GIL.
py::object tree_level(Reduction op, const char* name, const TensorTree& n, TreeLevelFn f);
/// A torch.Tensor argument of a tree call as its at::Tensor: a PendingTensor is waited for
/// first (a tree call reads the tensor without Python's __torch_function__). Needs the GIL.
inline at::Tensor unpack_tensor(py::handle h) {
  if (is_pending_tensor(h.ptr())) return THPVariable_Unpack(pending_result(h).ptr());
  return THPVariable_Unpack(h.ptr());
}

/// ttorch.apply(fn, *args, **kwargs): fn on every leaf of the tree arguments through the
/// runtime (its docstring in bind_runtime); Tensor.apply passes the tree first.
py::object apply_leafwise(const py::function& fn, const py::args& args, const py::kwargs& kwargs);

void bind_ops(py::module_& m, py::class_<PyTree>& cls);
void bind_runtime(py::module_& m);
void bind_io(py::module_& m);
void bind_structure(py::module_& m);
void bind_optim(py::module_& m);
void bind_pending(py::module_& m);

}  // namespace treetensor::python
