// Execution modes (stream), asyncs threads and scopes, synchronize, and apply() with Python
// callbacks: the leaf jobs run on the runtime's lanes with the GIL released by the caller and
// re-acquired around each callback, so lanes never deadlock on the GIL.

#include <c10/util/SmallVector.h>
#include <pthread.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "common.hpp"

namespace treetensor::python {
namespace {

runtime::StreamMode to_mode(py::handle h) {
  if (PyUnicode_Check(h.ptr())) {
    const std::string s = h.cast<std::string>();
    if (s == "auto" || s == "automatic") return runtime::StreamMode::of(runtime::automatic);
    if (s == "fused") return runtime::StreamMode::of(runtime::fused);
    throw py::value_error("treetensor: stream mode must be a lane count, 'auto' or 'fused', not '" +
                          s + "'");
  }
  if (PyBool_Check(h.ptr()) || !PyLong_Check(h.ptr()))
    throw py::type_error("treetensor: stream mode must be a lane count, 'auto' or 'fused'");
  const long long m = h.cast<long long>();
  if (m < 1) throw py::value_error("treetensor: stream(n) needs n >= 1, got " + std::to_string(m));
  return runtime::StreamMode::of(static_cast<std::size_t>(m));
}

/// A scoped StreamGuard / ThreadScope owned by Python: made by __enter__, ended by close() on
/// the OS thread that made it, innermost first among the open guards of its kind there. Each
/// C++ guard restores what it replaced, so a guard ended out of order or on another thread
/// would leave a finished scope in force; close() refuses those and the guard stays open.
class Guard {
 public:
  enum Kind : std::size_t { kStream, kScope };

  Guard(std::unique_ptr<runtime::StreamGuard> stream, std::unique_ptr<asyncs::ThreadScope> scope)
      : kind_(stream ? kStream : kScope),
        stream_(std::move(stream)),
        scope_(std::move(scope)),
        depth_(++open(kind_)) {}
  Guard(Guard&&) = default;
  Guard& operator=(Guard&&) = delete;
  /// A guard dropped unclosed (a generator left inside its `with`) ends only when it is the
  /// innermost on its own thread; otherwise its scope stays in force there.
  ~Guard() {
    if (is_open() && refusal().empty()) end();
    (void)stream_.release();
    (void)scope_.release();
  }

  /// Ends the scope. @throws std::runtime_error (RuntimeError) on another thread than the one
  /// that entered it, or while a scope of its kind entered after it is still open.
  void close() {
    if (!is_open()) return;
    if (const std::string why = refusal(); !why.empty()) throw std::runtime_error(why);
    end();
  }

 private:
  static std::size_t& open(Kind k) {
    thread_local std::array<std::size_t, 2> n{};
    return n[k];
  }
  // The calling thread's token: unlike std::thread::id, never reused by a later thread.
  static std::uint64_t thread_token() {
    static std::atomic<std::uint64_t> next{1};
    thread_local const std::uint64_t mine = next.fetch_add(1, std::memory_order_relaxed);
    return mine;
  }
  bool is_open() const { return stream_ || scope_; }
  void end() {
    stream_.reset();
    scope_.reset();
    --open(kind_);
  }
  std::string refusal() const {
    const std::string what = kind_ == kStream ? "ttorch.stream" : "asyncs.thread";
    if (owner_ != thread_token() || depth_ > open(kind_))
      return "treetensor: a " + what +
             " scope must be exited on the thread that entered it (scopes are per OS thread)";
    if (depth_ != open(kind_))
      return "treetensor: " + what +
             " scope exited out of order: " + std::to_string(open(kind_) - depth_) + " " + what +
             " scope(s) entered after it on this thread are still open; exit the innermost "
             "first";
    return {};
  }

  Kind kind_;
  std::unique_ptr<runtime::StreamGuard> stream_;
  std::unique_ptr<asyncs::ThreadScope> scope_;
  std::uint64_t owner_ = thread_token();
  std::size_t depth_;
};

struct PyThread {
  std::unique_ptr<asyncs::Thread> thread;
  PyThread() = default;
  PyThread(PyThread&&) = default;
  explicit PyThread(std::unique_ptr<asyncs::Thread> t) : thread(std::move(t)) {}
  // The drain may wait for submitted Python jobs, which need the GIL.
  // At interpreter shutdown (treetensor.asyncs closes its threads at exit before that) the
  // worker is left running: releasing the GIL during finalization is not allowed.
  ~PyThread() {
    if (!thread) return;
    if (!Py_IsInitialized() || _Py_IsFinalizing()) {
      (void)thread.release();
      return;
    }
    py::gil_scoped_release release;
    thread.reset();
  }
};

/// Held by a thread that makes itself a Python thread state, and by the forking thread over
/// fork(). CPython takes its lock over the list of thread states while it makes one, without
/// the GIL; a child forked meanwhile waits on that lock for ever, since 3.11's fork handling
/// deletes the parent's thread states before it renews the lock (DESIGN.md §10, fork()).
std::mutex& thread_state_mutex() {
  static auto* m = new std::mutex;  // never destroyed: a worker may outlive static destruction
  return *m;
}

/// The GIL on any thread, as pybind11's gil_scoped_acquire, but safe against a concurrent
/// fork(): a thread without a Python thread state (an asyncs worker, a lane) makes one under
/// thread_state_mutex for the scope and deletes it at the end, as gil_scoped_acquire would.
class Gil {
 public:
  Gil() {
    if (PyGILState_Check() != 0) return;  // this thread holds it (apply's leaves run here)
    if (PyGILState_GetThisThreadState() != nullptr) {
      held_.emplace();
      return;
    }
    {
      std::lock_guard lock(thread_state_mutex());
      own_ = PyThreadState_New(PyInterpreterState_Main());
    }
    if (own_ == nullptr) throw std::bad_alloc();  // CPython's only failure here: no memory
    PyEval_RestoreThread(own_);
  }
  ~Gil() {
    if (own_ == nullptr) return;
    PyThreadState_Clear(own_);
    PyThreadState_DeleteCurrent();  // with the GIL held, which a forking thread holds too
  }
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;

 private:
  std::optional<py::gil_scoped_acquire> held_;
  PyThreadState* own_ = nullptr;
};

/// A Python object that may be copied and dropped on any thread (takes the GIL for refcounts).
struct PyRef {
  PyObject* p = nullptr;
  PyRef() = default;
  explicit PyRef(py::object o) : p(o.release().ptr()) {}
  PyRef(PyRef&& o) noexcept : p(std::exchange(o.p, nullptr)) {}
  PyRef(const PyRef& o) : p(o.p) {
    if (p) {
      Gil gil;
      Py_INCREF(p);
    }
  }
  PyRef& operator=(const PyRef&) = delete;
  PyRef& operator=(PyRef&&) = delete;
  ~PyRef() {
    if (p && Py_IsInitialized() && !_Py_IsFinalizing()) {
      Gil gil;
      Py_DECREF(p);
    }
  }
};

/// A submitted Python job's outcome: its return value, or the exception it raised (kept as a
/// Python object, raised again by each result() call; no pybind11 error crosses threads).
struct PyOutcome {
  PyRef value;
  bool raised = false;
};

/// A Python job's exception that no result() has read yet. The job succeeds as far as the
/// asyncs layer knows (its outcome holds the exception), so synchronize() reports these itself
/// (DESIGN.md §10: no error is lost), in the order they were raised, each once.
struct PyFailure {
  PyRef exc;
  std::string context;  // "asyncs thread <id>, job <n>", filled in by submit
};
struct Unread {
  std::mutex m;
  std::vector<std::shared_ptr<PyFailure>> failures;
};
Unread& unread() {
  static auto* u = new Unread();  // leaked: jobs may fail during static destruction
  return *u;
}
void mark_read(const std::shared_ptr<PyFailure>& f) {
  Unread& u = unread();
  std::lock_guard lock(u.m);
  auto& v = u.failures;
  v.erase(std::remove(v.begin(), v.end(), f), v.end());
}

struct PyFuture {
  asyncs::Future<PyOutcome> future;
  std::shared_ptr<PyFailure> failure;  // where the job puts its exception, if it raises
  // Waits (GIL released); the outcome, its exception now read.
  const PyOutcome& outcome() const {
    if (!future.ready()) wait_interruptibly([this](auto slice) { return future.wait_for(slice); });
    const PyOutcome* out = nullptr;
    nogil([&] { out = &future.get(); });
    if (out->raised) mark_read(failure);
    return *out;
  }
};

// The unread exceptions of Python jobs, if any: the first raised again with its type, the
// context and a count (and the first few) of the others in its message.
void raise_unread() {
  std::vector<std::shared_ptr<PyFailure>> fs;
  {
    Unread& u = unread();
    std::lock_guard lock(u.m);
    fs.swap(u.failures);
  }
  if (fs.empty()) return;
  const auto text = [](const PyFailure& f) {
    return f.context + ": " + Py_TYPE(f.exc.p)->tp_name + ": " +
           py::str(f.exc.p).cast<std::string>();
  };
  std::string message = text(*fs.front());
  if (fs.size() > 1) {
    message += " (and " + std::to_string(fs.size() - 1) + " more unread asyncs job error(s)";
    for (std::size_t i = 1; i < fs.size() && i <= 3; ++i) message += "; " + text(*fs[i]);
    message += fs.size() > 4 ? "; ...)" : ")";
  }
  reraise(py::reinterpret_borrow<py::object>(fs.front()->exc.p), message);
}

/// The first Python exception raised by a callback of one apply() call.
struct CallbackError {
  std::mutex m;
  py::object value;  // written and destroyed with the GIL held
};

}  // namespace

[[noreturn]] void reraise(py::object exc, const std::string& message) {
  // Same type with the context (op, leaf path) in the message, chained to the original;
  // KeyboardInterrupt, SystemExit and types that cannot be built from a string: unchanged.
  py::handle type = py::handle(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())));
  if (!PyErr_GivenExceptionMatches(type.ptr(), PyExc_Exception)) {
    PyErr_SetObject(type.ptr(), exc.ptr());
    throw py::error_already_set();
  }
  py::object e;
  try {
    e = type(message);
  } catch (py::error_already_set&) {  // NOLINT(bugprone-empty-catch): the original, below
  }
  // A type not built from one string, or whose __new__ returns something else: the original.
  if (!e || PyObject_IsInstance(e.ptr(), type.ptr()) != 1) {
    PyErr_Clear();
    PyErr_SetObject(type.ptr(), exc.ptr());
    throw py::error_already_set();
  }
  PyException_SetCause(e.ptr(), exc.inc_ref().ptr());
  PyErr_SetObject(type.ptr(), e.ptr());
  throw py::error_already_set();
}

namespace {
// A Python job that forked returns in the child (its only thread): the process ends here, with
// the GIL held, before anything drops a Python reference or the GIL on a thread state that
// CPython's fork handling has reset (asyncs::Thread, fork()).
[[noreturn]] void end_forked_job(int status) {
  for (const char* stream : {"stdout", "stderr"}) {
    try {
      py::module_::import("sys").attr(stream).attr("flush")();
    } catch (py::error_already_set&) {  // NOLINT(bugprone-empty-catch): ending regardless
    }
  }
  std::fprintf(stderr,
               "treetensor asyncs: a process forked from an asyncs job ends as that job returns "
               "(exit status %d); end such a child with os._exit inside the job\n",
               status);
  std::fflush(nullptr);
  _exit(status);
}

// The exit status of a forked job that raised `e`: sys.exit's code, else 1 (traceback printed).
int forked_job_status(py::error_already_set& e) {
  if (e.matches(PyExc_SystemExit)) {
    const py::object code = e.value().attr("code");
    if (code.is_none()) return 0;
    if (!PyLong_Check(code.ptr())) return 1;
    const long v = PyLong_AsLong(code.ptr());
    PyErr_Clear();  // out of range: -1, as the status of a failure
    return static_cast<int>(v);
  }
  e.restore();
  PyErr_Print();
  return 1;
}

}  // namespace

void wait_interruptibly(const std::function<bool(std::chrono::milliseconds)>& done_within) {
  if (asyncs::current_thread_id()) return;
  const auto watchdog = asyncs::watchdog_timeout();
  const auto until = std::chrono::steady_clock::now() + watchdog;
  for (;;) {
    bool done = false;
    {
      py::gil_scoped_release release;
      done = done_within(std::chrono::milliseconds(50));
    }
    if (done) return;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (watchdog.count() != 0 && std::chrono::steady_clock::now() >= until) return;
  }
}

// apply's leaves run here, in order, with the GIL held throughout, when the runtime would run
// them on this thread anyway: one tree argument, the default stream mode or stream(1), no
// asyncs scope or job (they take calls over) and no tracked operand (a job writing a leaf).
// Saves a release and a retake of the GIL per leaf and the zip of one tree with itself (the
// overhead of apply(lambda x: x) over 3 leaves: 2.05 -> 1.24 us here). Runtime call hooks
// other than asyncs' are not asked: none is registered by treetensor's layers.
bool apply_runs_here(const std::vector<Operand>& ops) {
  const runtime::StreamMode mode = runtime::current_stream_mode();
  return ops.size() == 1 && ops[0].is_tree() && mode.kind == runtime::StreamMode::Kind::lanes &&
         mode.lanes == 1 && !asyncs::routes_calls() && !asyncs::tracking_active();
}

// The leaves of `t` in flatten order, run as run_linear runs them (every leaf runs; the
// failures are reported together, the first one's type kept), their results risen as
// map_leaves_multi rises them.
class InlineLeaves {
 public:
  explicit InlineLeaves(const TensorTree& t) : t_(t) {}

  template <class F>
  void run(F&& f) {
    walk(t_, f);
  }
  /// Rethrows as runtime::run would, naming the op and the first failing leaf.
  void rethrow_if_any(std::string_view op) const {
    if (!failures_.empty()) runtime::rethrow_leaf_failures(op, failures_);
  }
  /// Tree k holds every leaf's result k.
  /// @throws tree::StructureError naming the first leaf whose count differs from the first's.
  std::vector<TreeTensor> rise(std::string_view op) {
    const std::size_t count = results_.empty() ? 0 : results_[0].size();
    for (std::size_t i = 1; i < results_.size(); ++i)
      if (results_[i].size() != count) {
        const auto paths = t_.paths();
        throw tree::StructureError(paths[i], std::string(op) + ": leaf '" + paths[i].describe() +
                                                 "' gave " + std::to_string(results_[i].size()) +
                                                 " results but leaf '" + paths[0].describe() +
                                                 "' gave " + std::to_string(count));
      }
    std::vector<TreeTensor> out;
    for (std::size_t k = 0; k < count; ++k) {
      std::size_t next = 0;
      out.emplace_back(build(t_, k, next));
    }
    return out;
  }

 private:
  template <class F>
  void walk(const TensorTree& t, F& f) {
    if (t.is_leaf()) {
      try {
        results_.push_back(f(t.leaf()));
      } catch (...) {
        results_.emplace_back();
        failures_.push_back({where_.describe(), std::current_exception()});
      }
      return;
    }
    for (const auto& [k, v] : t) {
      where_.push_back(k);
      walk(v, f);
      where_.pop_back();
    }
  }
  TensorTree build(const TensorTree& t, std::size_t k, std::size_t& next) {
    if (t.is_leaf()) return TensorTree(std::move(results_[next++][k]));
    TensorTree::Children ch;
    ch.reserve(t.size());
    for (const auto& [key, v] : t) ch.emplace_back(key, build(v, k, next));
    return TensorTree::from_children(std::move(ch));
  }

  const TensorTree& t_;
  tree::Path where_;
  std::vector<std::vector<at::Tensor>> results_;
  std::vector<runtime::LeafFailure> failures_;
};

py::object apply_leafwise(const py::function& fn, const py::args& args, const py::kwargs& kwargs) {
  Args keep;
  std::vector<Operand> ops;
  std::vector<int> slot;  // per Python argument: operand index, or -1 (passed as is)
  for (auto a : args) {
    if (is_tree(a) || PyDict_Check(a.ptr()) || (!is_tensor(a) && is_foreign_tree(a))) {
      slot.push_back(static_cast<int>(ops.size()));
      ops.push_back(keep.add(a));
    } else {
      slot.push_back(-1);
    }
  }
  if (ops.empty()) return fn(*args, **kwargs);
  CallbackError err;
  std::atomic<int> single{-1};  // 1: fn returned a tensor, 0: a tuple of tensors
  // fn on one leaf; tensor(k) is the leaf of tree operand k.
  auto on_leaf = [&](auto&& tensor) -> std::vector<at::Tensor> {
    Gil gil;
    try {
      // One vectorcall: pybind11's fn(*call, **kwargs) copies both into new containers on
      // every leaf, and argument tuples (tracked by Python's GC) start collections.
      c10::SmallVector<py::object, 4> call(slot.size());
      c10::SmallVector<PyObject*, 4> argv(slot.size());
      for (std::size_t i = 0; i < slot.size(); ++i) {
        call[i] = slot[i] < 0 ? py::reinterpret_borrow<py::object>(args[i])
                              : wrap_tensor(tensor(slot[i]));
        argv[i] = call[i].ptr();
      }
      auto r = py::reinterpret_steal<py::object>(PyObject_VectorcallDict(
          fn.ptr(), argv.data(), argv.size(), kwargs.empty() ? nullptr : kwargs.ptr()));
      if (!r) throw py::error_already_set();
      std::vector<at::Tensor> out;
      int kind = 1;
      if (is_tensor(r)) {
        out.push_back(unpack_tensor(r));
      } else if (PyTuple_Check(r.ptr()) || PyList_Check(r.ptr())) {
        kind = 0;
        for (auto v : r) {
          if (!is_tensor(v))
            throw py::type_error("apply: fn returned a sequence holding a " +
                                 std::string(Py_TYPE(v.ptr())->tp_name) + ", not only tensors");
          out.push_back(unpack_tensor(v));
        }
      } else {
        throw py::type_error(
            std::string("apply: fn must return a torch.Tensor or a tuple of them, not ") +
            Py_TYPE(r.ptr())->tp_name);
      }
      int expected = -1;
      if (!single.compare_exchange_strong(expected, kind) && expected != kind)
        throw py::type_error("apply: fn returned a tensor for some leaves and a tuple for others");
      return out;
    } catch (py::error_already_set& e) {
      {
        std::lock_guard<std::mutex> lock(err.m);
        if (!err.value) err.value = e.value();
      }
      // "ZeroDivisionError: division by zero" (no Python traceback in the message)
      throw std::runtime_error(std::string(Py_TYPE(e.value().ptr())->tp_name) + ": " +
                               py::str(e.value()).cast<std::string>());
    } catch (py::builtin_exception& e) {
      {
        std::lock_guard<std::mutex> lock(err.m);
        if (!err.value) {
          e.set_error();
          py::error_already_set s;
          err.value = s.value();
        }
      }
      throw std::runtime_error(e.what());
    }
  };
  std::vector<TreeTensor> out;
  try {
    if (apply_runs_here(ops)) {
      // fn is Python code: the tree's keys stay while the leaves are walked, as for map
      std::optional<RootUse> use;
      for (std::size_t i = 0; i < slot.size(); ++i)
        if (slot[i] == 0 && is_tree(args[i])) use.emplace(*as_tree(args[i]).root);
      InlineLeaves leaves(ops[0].tree());
      leaves.run([&](const at::Tensor& x) { return on_leaf([&](int) { return x; }); });
      leaves.rethrow_if_any("apply");
      out = leaves.rise("apply");
    } else {
      detail::CallOptions o{"apply"};
      o.wrap_scalars = true;
      out = nogil([&] {
        return detail::map_leaves_multi(o, ops, [&](const detail::LeafArgs& x) {
          return on_leaf([&](int k) -> const at::Tensor& { return x.t(k); });
        });
      });
    }
  } catch (const std::runtime_error& e) {
    if (err.value) reraise(err.value, e.what());
    throw;
  }
  if (single.load() == 1) return wrap(std::move(out.at(0)));
  // No leaf, so fn never ran: the structure (DI-treetensor keeps {'a': {}}), not a tuple.
  if (single.load() == -1) return wrap(TreeTensor(ops.at(0).tree()));
  py::tuple t(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) t[i] = wrap(std::move(out[i]));
  return t;
}

void bind_runtime(py::module_& m) {
  // Unread::m (taken by submit with the GIL released) and thread_state_mutex are held over
  // fork(): a child forked meanwhile must not inherit them locked (DESIGN.md §10, fork()).
  // They are never held together elsewhere, so the order here is free.
  unread();
  thread_state_mutex();
  if (const int err = pthread_atfork(
          [] {
            thread_state_mutex().lock();
            unread().m.lock();
          },
          [] {
            unread().m.unlock();
            thread_state_mutex().unlock();
          },
          [] {
            unread().m.unlock();
            thread_state_mutex().unlock();
          }))
    throw std::system_error(err, std::generic_category(), "treetensor: pthread_atfork");
  m.def(
      "set_stream",
      [](py::handle mode) {
        const runtime::StreamMode md = to_mode(mode);
        switch (md.kind) {
          case runtime::StreamMode::Kind::automatic:
            runtime::stream(runtime::automatic);
            break;
          case runtime::StreamMode::Kind::fused:
            runtime::stream(runtime::fused);
            break;
          default:
            runtime::stream(md.lanes);
        }
      },
      py::arg("mode"), "Sets the process-wide execution mode: n lanes, 'auto' or 'fused'.");
  m.def(
      "current_stream", [] { return runtime::current_stream_mode().to_string(); },
      "The mode of this thread's tree calls, e.g. 'stream(2)'.");

  m.def("_describe_stream", [](py::handle mode) { return to_mode(mode).to_string(); });
  py::class_<Guard>(m, "_Guard").def("close", &Guard::close);
  m.def("_stream_guard", [](py::handle mode) {
    return Guard(std::make_unique<runtime::StreamGuard>(to_mode(mode)), nullptr);
  });
  m.def(
      "synchronize",
      [] {
        const asyncs::WorkMark submitted = asyncs::mark_all();
        wait_interruptibly([&](auto slice) { return submitted.wait_for(slice); });
        nogil([] { runtime::synchronize(); });
        raise_unread();
      },
      "Waits for every tree call and asyncs job in flight; raises the first unobserved asyncs "
      "job error (C++ tree-call errors first, then Python jobs' exceptions no result() read), "
      "naming how many more there were. Ctrl-C interrupts the wait (KeyboardInterrupt; the "
      "jobs run on).");

  // Before _AsyncThread, whose submit returns one: its signature then names the Python type.
  py::class_<PyFuture>(m, "_Future")
      .def("done", [](const PyFuture& f) { return f.future.ready(); })
      .def("result",
           [](const PyFuture& f) -> py::object {
             const PyOutcome& out = f.outcome();
             if (out.raised) {
               PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(out.value.p)), out.value.p);
               throw py::error_already_set();
             }
             return py::reinterpret_borrow<py::object>(out.value.p);
           })
      // (raised, value or exception): asyncs.Future keeps these as Python attributes and drops
      // this object, so that a cycle through the exception's traceback (a frame holding the
      // future) is one the garbage collector can see and break.
      .def("_outcome", [](const PyFuture& f) {
        const PyOutcome& out = f.outcome();
        return py::make_tuple(out.raised, py::reinterpret_borrow<py::object>(out.value.p));
      });
  py::class_<PyThread>(m, "_AsyncThread")
      .def(py::init([](const std::string& name) {
             return PyThread(std::make_unique<asyncs::Thread>(name));
           }),
           py::arg("name") = "")
      .def_property_readonly("id", [](const PyThread& t) { return t.thread->id(); })
      .def("in_flight", [](const PyThread& t) { return t.thread->in_flight(); })
      .def("wait_idle",
           [](const PyThread& t) {
             const asyncs::WorkMark submitted = t.thread->mark();
             wait_interruptibly([&](auto slice) { return submitted.wait_for(slice); });
             nogil([&] { t.thread->wait_idle(); });
           })
      .def("close", [](PyThread& t) { nogil([&] { t.thread->close(); }); })
      .def(
          "submit",
          [](PyThread& t, py::function fn, py::args args, py::kwargs kwargs) {
            auto failure = std::make_shared<PyFailure>();
            auto job = [f = PyRef(fn), a = PyRef(args), k = PyRef(kwargs), failure]() {
              Gil gil;
              const pid_t pid = getpid();
              try {
                py::object r = py::reinterpret_borrow<py::function>(f.p)(
                    *py::reinterpret_borrow<py::tuple>(a.p),
                    **py::reinterpret_borrow<py::dict>(k.p));
                if (getpid() != pid) end_forked_job(0);
                return PyOutcome{PyRef(std::move(r)), false};
              } catch (py::error_already_set& e) {
                if (getpid() != pid) end_forked_job(forked_job_status(e));
                failure->exc.p = e.value().inc_ref().ptr();
                Unread& u = unread();
                std::lock_guard lock(u.m);
                u.failures.push_back(failure);
                return PyOutcome{PyRef(e.value()), true};
              }
            };
            asyncs::Future<PyOutcome> fut;
            {
              // The context is written under the lock synchronize() reads it with.
              py::gil_scoped_release release;
              fut = t.thread->submit(std::move(job));  // may wait (back-pressure)
              std::lock_guard lock(unread().m);
              failure->context = "asyncs thread " + std::to_string(fut.thread_id()) + ", job " +
                                 std::to_string(fut.job());
            }
            return PyFuture{std::move(fut), std::move(failure)};
          },
          py::arg("fn"));
  m.def(
      "_thread_scope",
      [](const PyThread& t, bool blocking) {
        return Guard(nullptr, std::make_unique<asyncs::ThreadScope>(
                                  *t.thread, blocking ? asyncs::ScopeMode::blocking
                                                      : asyncs::ScopeMode::pending));
      },
      py::arg("thread"), py::arg("blocking") = false);
  m.def("_current_thread_id", [] { return asyncs::current_thread_id(); });

  m.def(
      "apply", &apply_leafwise, py::arg("fn"),
      "fn(leaf_a, leaf_b, ...) on every leaf of the tree arguments (zipped strictly; other "
      "arguments and keywords passed as they are), through the runtime: under stream(n) the leaves "
      "run on "
      "n lanes, each callback holding the GIL. fn returns a tensor (result: a tree) or a tuple "
      "of tensors (result: a tuple of trees).");
}

}  // namespace treetensor::python
