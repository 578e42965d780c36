#pragma once
// asyncs threads: named worker threads that run submitted work beside the main compute
// (DESIGN.md §10; OneFlow parity: `oneflow.asyncs.thread(worker)`), with errors that surface
// instead of aborting the process. The asyncs layer sits above the runtime (DESIGN.md, layers):
// the runtime never knows it; the first Thread installs this layer's hooks on the runtime's
// dispatch point (runtime::add_call_hook, runtime::add_synchronize_hook in dispatch.hpp).
//
//     asyncs::Thread metrics;                                   // takes worker id 1..N
//     auto f = metrics.submit([&] { return loss.item<double>(); }, {loss}, {});
//     ... next training step ...
//     double l = f.get();                                       // rethrows the job's error
//
//     { asyncs::ThreadScope scope(metrics);                     // tree calls of this block
//       auto m = tt::leaf_mean(losses); }                      // queued on `metrics`: m is
//     ... next training step ...                                // pending, the caller goes on
//     std::cout << m;                                           // reading m waits for its job
//     runtime::synchronize();                                   // all asyncs work done
//
// Rules that hold everywhere below:
//  - FIFO: the jobs of one Thread run one after another in submission order, on one OS thread.
//  - Streams: with CUDA, each worker runs its jobs on its own stream per device (from c10's
//    stream pool). A job first waits (device-side event) for the submitter's current stream on
//    each device of its operand tensors; get()/wait()/await_operands() make the caller's
//    current stream wait for the job's streams. Tensors that are not passed as operands get no
//    such ordering. Without CUDA none of this costs anything.
//  - Thread-local state of the submitter (grad mode, inference mode, autocast, dispatch keys;
//    at::ThreadLocalState) and its stream(M) mode (StreamGuard or process-wide) are captured at
//    submit() and installed around the job, so a scoped tree call behaves as it would inline.
//  - Errors: an exception thrown by a job is stored, never lost and never fatal. It is rethrown
//    with its original type (see rethrow_with_context) and the context
//    "asyncs thread <id>, job <n>[ '<label>']" by Future::get()/wait(); a job error that no
//    get()/wait() has observed is reported by the next runtime::synchronize(). The runtime
//    stays usable.
//    Errors still unobserved when the process exits (std::exit or a return from main) are
//    printed to stderr, one line each: "treetensor: asyncs thread <id>, job <n>: error never
//    observed: <message>".
//  - fork(): only the forking thread survives in the child, so no worker does. In the child,
//    every job that was queued or running at the fork has failed with AsyncsUsageError ("...
//    in flight when the process forked"), raised by its futures, the reads of its results and
//    synchronize(); a Thread made before the fork throws AsyncsUsageError on every use but
//    close() and destruction, which return at once; new Threads work as usual (ids start
//    again from 1). The parent is unaffected. Read what the child needs before forking. A job
//    that forks runs on in the child on a thread that is no worker there; when it returns, the
//    child ends (exit status 0, or 1 if the job failed, with a line on stderr): end such a
//    child with exec or _exit inside the job.
//  - Environment: TREETENSOR_WATCHDOG_MS and TREETENSOR_ASYNCS_MAX_IN_FLIGHT are read once, by
//    the first use of the getters below. An invalid value never terminates the process: the
//    default stays in force and every Thread construction throws std::invalid_argument naming
//    the variable, its value and the valid range.
//  - Watchdog: with a timeout set (TREETENSOR_WATCHDOG_MS or set_watchdog_timeout()), every
//    blocking wait of this API — get, wait, synchronize, await_operands, back-pressure, scoped
//    tree calls — throws WatchdogTimeout, listing the in-flight jobs, when no asyncs job
//    anywhere finishes for that long. Off by default.
//  - Back-pressure: at most max_in_flight() jobs (queued plus running) per thread; submit()
//    blocks past that until the thread drains below it.

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/util/ArrayRef.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace treetensor::asyncs {

/// Thrown by the Thread constructor when every worker id of the pool is taken.
class ThreadPoolExhausted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Thrown for a use of the asyncs API that could only deadlock or cannot work: waiting from a
/// job for a job queued behind it on the same thread, a wait from a job (get/wait, a scoped
/// tree call, wait_idle) for a thread that is itself, directly or through others, waiting for
/// the waiting job's thread (a cycle of waits, refused when the wait starts), synchronize()
/// from inside a job, submitting to a moved-from or closed Thread.
class AsyncsUsageError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

/// One job that had not finished when a WatchdogTimeout was raised.
struct InFlightJob {
  int thread = 0;         ///< asyncs thread id (1..max_threads())
  std::uint64_t job = 0;  ///< job number on that thread, counting from 1
  std::string label;      ///< the submitter's label, may be empty
  bool running = false;   ///< running (true) or still queued (false)
  double seconds = 0;     ///< seconds since the job started (running) or was submitted
};

/// A blocking asyncs wait made no progress (no asyncs job finished) for the watchdog timeout.
/// what() names the wait and lists the in-flight jobs; jobs() gives them structured.
class WatchdogTimeout : public std::runtime_error {
 public:
  WatchdogTimeout(const std::string& what, std::vector<InFlightJob> jobs)
      : std::runtime_error(what), jobs_(std::move(jobs)) {}
  const std::vector<InFlightJob>& jobs() const noexcept { return jobs_; }

 private:
  std::vector<InFlightJob> jobs_;
};

/// Size of the worker id pool: environment TREETENSOR_ASYNCS_THREADS (1..1024) read once, else
/// 8. Thread safety: safe from any thread.
std::size_t max_threads();

/// Watchdog timeout; zero means off. Initial value: TREETENSOR_WATCHDOG_MS (milliseconds,
/// 0..86400000, 0 = off) or off; an invalid value keeps it off and makes the Thread constructor
/// throw (see Environment above). The setter takes effect for waits that start afterwards.
/// @throws std::invalid_argument for a negative timeout.
/// Thread safety: safe from any thread.
void set_watchdog_timeout(std::chrono::milliseconds timeout);
std::chrono::milliseconds watchdog_timeout() noexcept;

/// Back-pressure high-water mark: jobs in flight (queued plus running) per thread past which
/// submit() blocks. Initial value: TREETENSOR_ASYNCS_MAX_IN_FLIGHT (1..2^30) or 1024; an invalid
/// value keeps 1024 and makes the Thread constructor throw (see Environment above).
/// @throws std::invalid_argument for zero.
/// Thread safety: safe from any thread; applies to submits that start afterwards.
void set_max_in_flight(std::size_t jobs);
std::size_t max_in_flight() noexcept;

/// Id of the asyncs thread whose job the calling OS thread is running — on the worker itself
/// or in a lane running a leaf of a tree call made by that job — or nullopt.
std::optional<int> current_thread_id() noexcept;

/// Whether asyncs takes over the tree calls the calling OS thread makes now (a ThreadScope is
/// active on it, or it runs an asyncs job): a caller that would run a call's leaves itself,
/// outside runtime::run, must hand the call to runtime::run when this is true.
bool routes_calls() noexcept;

/// How many intra-op threads the ATen kernels of an asyncs thread's jobs use.
///
/// An asyncs thread runs beside the main compute, so two kernel callers share the cores; if
/// each spreads its kernels over every core they oversubscribe them. Only thread-local settings
/// are changed: BLAS libraries with one process-wide thread count (OpenBLAS with pthreads) are
/// left alone, because changing that count while the main thread computes would make the main
/// thread's results depend on timing. Set OPENBLAS_NUM_THREADS at start-up to limit them.
enum class KernelThreads {
  /// Default: the worker runs ATen intra-op work (at::parallel_for) on itself only, through
  /// its own OpenMP setting (and MKL's thread-local count when MKL is present).
  one,
  /// The process-wide intra-op setting (at::get_num_threads()): for heavy jobs on a machine
  /// with cores to spare.
  process,
};

class Thread;
class ThreadScope;
class PendingTarget;
template <class T>
class Future;

namespace detail {

class Worker;

/// State shared by a job and its futures. `done` is set (release) after the result and error
/// are stored; the other fields are written once before the job is queued or before `done`.
/// A failed job stays on the asyncs layer's unobserved list until a get()/wait() or synchronize()
/// reports it.
// Shared from `this` by the operand registry, which keeps plain pointers to registered jobs.
struct JobState : std::enable_shared_from_this<JobState> {
  virtual ~JobState() = default;
  std::atomic<bool> done{false};
  int thread = 0;
  std::uint64_t number = 0;     // job number on its thread, from 1
  std::uint64_t seq = 0;        // global submission order
  std::uint64_t submitter = 0;  // seq of the job that submitted this one, 0 if none
  std::string label;
  std::exception_ptr error;
  std::vector<c10::Event> finished;  // CUDA: recorded on the worker streams after the job
  // Operands registered after submission (add_operands) and whether the job counts among the
  // tracked ones; guarded by the asyncs layer's lock.
  std::vector<std::pair<const void*, bool>> late_keys;  // (storage key, written)
  std::vector<at::Tensor> late_operands;
  bool tracked = false;
};

template <class T>
struct Result final : JobState {
  std::optional<T> value;
};
template <>
struct Result<void> final : JobState {};

template <class T>
struct GetResult {
  using type = const T&;
};
template <>
struct GetResult<void> {
  using type = void;
};

/// A type-erased job body; run() stores its result into the job's state.
struct Task {
  virtual ~Task() = default;
  virtual void run() = 0;
};

template <class F, class T>
struct TaskImpl final : Task {
  TaskImpl(F f, std::shared_ptr<Result<T>> r) : fn(std::move(f)), out(std::move(r)) {}
  void run() override {
    if constexpr (std::is_void_v<T>) {
      std::invoke(fn);
    } else {
      out->value.emplace(std::invoke(fn));
    }
  }
  F fn;
  std::shared_ptr<Result<T>> out;
};

/// Queues a job on `worker` (blocking for back-pressure) and fills in state's ids.
void enqueue(Worker& worker, std::shared_ptr<JobState> state, std::unique_ptr<Task> task,
             c10::ArrayRef<at::Tensor> reads, c10::ArrayRef<at::Tensor> writes, std::string label);
/// Blocks until `state` is done (watchdog), joins streams, marks its error observed, rethrows it.
void wait_job(JobState& state);
/// Blocks until `state` is done or `timeout` has passed; whether it is done. No watchdog, no
/// usage checks, nothing rethrown or observed.
bool wait_job_for(const JobState& state, std::chrono::milliseconds timeout);
/// Registers more operands of an unfinished job (Future::add_operands).
void add_operands(const std::shared_ptr<JobState>& state, c10::ArrayRef<at::Tensor> reads,
                  c10::ArrayRef<at::Tensor> writes);

}  // namespace detail

/// The result of one submitted job (like std::shared_future: copyable, get() may be called
/// any number of times, from any thread).
template <class T>
class Future {
 public:
  Future() = default;

  /// Whether this future refers to a job (a default-constructed one does not).
  bool valid() const noexcept { return state_ != nullptr; }
  /// Whether the job has finished (successfully or not). Never blocks, never throws.
  bool ready() const noexcept { return state_ && state_->done.load(std::memory_order_acquire); }
  /// Whether the job has finished with an error. Never blocks, never throws, and does not
  /// count as observing the error (get()/wait() and synchronize() still report it).
  bool failed() const noexcept { return ready() && state_->error != nullptr; }
  /// Blocks until the job has finished; rethrows its exception with original type and context
  /// "asyncs thread <id>, job <n>".
  /// @throws the job's exception; WatchdogTimeout; AsyncsUsageError when called from a job of
  ///         the same thread for a job queued behind it, from a job whose wait would close a
  ///         cycle of waits, or on an invalid future.
  void wait() const { detail::wait_job(checked()); }
  /// Blocks until the job has finished or `timeout` has passed; returns ready(). Neither
  /// rethrows, joins streams nor counts as observing an error; no watchdog (a caller waiting in
  /// slices, e.g. to let Python handle Ctrl-C between them, then calls wait()).
  /// @throws AsyncsUsageError on an invalid future.
  bool wait_for(std::chrono::milliseconds timeout) const {
    return detail::wait_job_for(checked(), timeout);
  }
  /// wait(), then the job's value (a reference valid while a future of this job lives).
  typename detail::GetResult<T>::type get() const {
    wait();
    if constexpr (!std::is_void_v<T>) return *state_->value;
  }
  /// Registers `reads` and `writes` as further operands of the job, as submit() does for its
  /// own (operand tracking, operands.hpp), until the job finishes; nothing once it has. For
  /// operands whose tensors exist only after the job was submitted: a pending tree call's
  /// pending operand, once made (DESIGN.md §10, pending scopes). Never blocks on the job.
  /// @throws AsyncsUsageError on an invalid future.
  void add_operands(c10::ArrayRef<at::Tensor> reads, c10::ArrayRef<at::Tensor> writes) const {
    checked();
    detail::add_operands(state_, reads, writes);
  }
  /// Asyncs thread id (1..max_threads()) and job number (from 1) of the job.
  int thread_id() const { return checked().thread; }
  std::uint64_t job() const { return checked().number; }

 private:
  friend class Thread;
  friend class PendingTarget;
  explicit Future(std::shared_ptr<detail::Result<T>> s) : state_(std::move(s)) {}
  detail::Result<T>& checked() const {
    if (!state_) throw AsyncsUsageError("treetensor asyncs: use of an invalid (default) Future");
    return *state_;
  }
  std::shared_ptr<detail::Result<T>> state_;
};

/// The jobs submitted up to a moment (to every asyncs thread: mark_all(), or to one:
/// Thread::mark()), for a caller that waits for them in slices, e.g. to let Python handle
/// Ctrl-C between them, and then calls runtime::synchronize() or Thread::wait_idle(). Work
/// submitted after the mark does not move it, so a producer that keeps submitting never makes
/// such a wait endless. Thread safety: safe from any thread.
class WorkMark {
 public:
  /// Blocks until every job of the mark has finished or `timeout` has passed; returns whether
  /// they have. It neither reports errors, joins streams nor has a watchdog; from a job of a
  /// marked thread it only times out (it would wait for itself).
  bool wait_for(std::chrono::milliseconds timeout) const;

 private:
  friend WorkMark mark_all();
  friend class Thread;
  std::vector<std::pair<std::shared_ptr<detail::Worker>, std::uint64_t>> targets_;
};

/// The jobs submitted so far to every live asyncs thread: what synchronize() waits for.
WorkMark mark_all();

/// An asyncs worker thread (OneFlow parity: `oneflow.asyncs.thread`). Owns a worker id taken
/// from a pool of max_threads() ids, and one OS thread that runs the submitted jobs in FIFO
/// order.
///
/// Destruction rule (drain): the destructor waits until every job already submitted has run,
/// then returns the id to the pool. It never throws: errors of jobs whose futures were not
/// observed are kept and reported by the next synchronize(). With the watchdog on, a drain that
/// makes no progress prints the in-flight jobs to stderr once per timeout and keeps waiting.
/// Destroyed from one of its own jobs (or a lane running a leaf of such a job), it cannot drain,
/// as the job would wait for itself: it detaches instead. The destructor prints a line naming
/// the thread to stderr and returns at once; the worker runs the jobs already queued (further
/// submits are impossible: the Thread is gone), then ends and frees its id. synchronize()
/// still waits for those jobs.
///
/// close() does the same drain (or detach) at once, leaving a closed Thread (as
/// concurrent.futures' shutdown does): submit() throws AsyncsUsageError, id() still gives the
/// id it had (which a later Thread may take again), in_flight() is 0, wait_idle() and close()
/// return at once; destruction then does nothing.
///
/// Thread safety: submit(), id(), in_flight() and wait_idle() may be called concurrently from
/// any threads; construction, move, close() and destruction may not race with other calls.
class Thread {
 public:
  /// Takes the smallest free worker id and starts the worker.
  /// @param name     optional name of the worker (for debugging; watchdog reports give ids).
  /// @param kernels  threads for the jobs' kernels, see KernelThreads.
  /// @throws ThreadPoolExhausted when all max_threads() ids are taken; std::invalid_argument
  ///         when TREETENSOR_WATCHDOG_MS, TREETENSOR_ASYNCS_MAX_IN_FLIGHT or
  ///         TREETENSOR_ASYNCS_THREADS is invalid (message: variable, value, valid range).
  explicit Thread(std::string name = {}, KernelThreads kernels = KernelThreads::one);
  ~Thread();
  Thread(Thread&& other) noexcept;
  Thread(const Thread&) = delete;
  Thread& operator=(const Thread&) = delete;
  Thread& operator=(Thread&&) = delete;

  /// Queues `fn()` on this thread after every job submitted before.
  ///
  /// Operand ordering (OneFlow parity): the job starts only when the jobs submitted before it
  /// on other threads that conflict with its operands (one writes what the other reads or
  /// writes) have finished; later tree calls on the submitting side wait for it through
  /// await_operands(). Tensors the job touches without declaring them get no ordering.
  ///
  /// @param fn      a callable taking no arguments (moved or copied into the job; it may be
  ///                move-only). Its result (decayed) is the future's value; void is supported.
  /// @param reads   tensors `fn` reads: later in-place ops on them wait for the job
  ///                (await_operands). Kept alive until the job has finished.
  /// @param writes  tensors `fn` writes: later reads and writes of them wait for the job.
  ///                (Trees of operands: treetensor::submit in treetensor/tensor/submit.hpp.)
  /// @param label   short text naming the job in errors and watchdog reports.
  /// @returns a Future for the job's value or error.
  /// @throws AsyncsUsageError on a moved-from or closed Thread, or one made before this process
  ///         forked (see fork() above); WatchdogTimeout while blocked for
  ///         back-pressure. Never blocks for back-pressure when called from this thread's own
  ///         jobs (the queue could not drain meanwhile).
  template <class F>
  auto submit(F&& fn, c10::ArrayRef<at::Tensor> reads = {}, c10::ArrayRef<at::Tensor> writes = {},
              std::string label = {})
      -> Future<std::remove_cvref_t<std::invoke_result_t<std::decay_t<F>&>>> {
    using T = std::remove_cvref_t<std::invoke_result_t<std::decay_t<F>&>>;
    auto state = std::make_shared<detail::Result<T>>();
    auto task = std::make_unique<detail::TaskImpl<std::decay_t<F>, T>>(std::forward<F>(fn), state);
    detail::enqueue(worker(), state, std::move(task), reads, writes, std::move(label));
    return Future<T>(std::move(state));
  }

  /// Worker id, 1..max_threads(); after close(), the id it had.
  /// @throws AsyncsUsageError on a moved-from Thread.
  int id() const;
  /// Jobs submitted and not yet finished (queued plus running); 0 once closed.
  /// @throws AsyncsUsageError on a moved-from Thread.
  std::size_t in_flight() const;
  /// Blocks until every job submitted so far has finished; returns at once once closed. Does
  /// not throw job errors (they stay with futures and synchronize()). @throws WatchdogTimeout;
  /// AsyncsUsageError when called from this thread's own jobs or on a moved-from Thread.
  void wait_idle() const;
  /// The jobs submitted to this thread so far (what wait_idle() waits for), as a WorkMark; an
  /// empty mark once closed. @throws AsyncsUsageError on a moved-from Thread.
  WorkMark mark() const;
  /// Drains (or, from its own job, detaches) and frees the id now, as the destructor would;
  /// afterwards the Thread is closed (see the class comment). A second call does nothing.
  /// Never throws job errors; @throws AsyncsUsageError on a moved-from Thread.
  void close();
  /// Whether close() has run.
  bool closed() const noexcept { return closed_id_ != 0; }

 private:
  friend class ThreadScope;
  detail::Worker& worker() const;
  std::shared_ptr<detail::Worker> worker_;
  int closed_id_ = 0;  // the id this Thread had, once closed
};

/// How the tree calls of a ThreadScope run on its thread.
enum class ScopeMode {
  /// Default (OneFlow parity): a tree call of the tensor layer's ops returns at once a pending
  /// result (DESIGN.md §10, "pending scopes"), and the caller goes on while the thread runs it.
  pending,
  /// The caller blocks until the call has run on the thread (its worker, its streams), so
  /// values are ready when the call returns.
  blocking,
};

/// Makes the tree calls of a block run on an asyncs thread (OneFlow parity:
/// `with oneflow.asyncs.thread(worker):`).
///
/// Pending (the default): each tree call of the tensor layer's ops made on the calling OS
/// thread is queued on `thread` as a job (FIFO after earlier submits) and returns at once a
/// pending tree: its content is made when first looked at, which waits for exactly that job
/// (tree::Tree::is_pending; DESIGN.md §10 lists the ops that go pending and the rest, which
/// run as blocking calls). In-place calls leave their target trees pending the same way. A
/// job's error is thrown by every read of its result, with context "asyncs thread <id>, job
/// <n> 'tree call <op>'"; one nobody read is reported by runtime::synchronize().
/// Blocking: each tree call is queued on `thread` and the caller blocks until it has finished;
/// its error is rethrown to the caller with the same context.
/// Either way: scopes nest (the innermost wins and the outer one is restored when it ends); a
/// scope naming the thread that is already running the code (inside its own job) runs calls
/// inline; only the OS thread that created the scope is affected, not the lanes a call uses.
///
/// Thread safety: a scope is bound to the OS thread that created it and must be destroyed on
/// it, in reverse order of creation. `thread` must outlive the scope.
/// @throws AsyncsUsageError (constructor) on a moved-from or closed Thread.
class ThreadScope {
 public:
  explicit ThreadScope(const Thread& thread, ScopeMode mode = ScopeMode::pending);
  ~ThreadScope();
  ThreadScope(const ThreadScope&) = delete;
  ThreadScope& operator=(const ThreadScope&) = delete;

 private:
  std::shared_ptr<detail::Worker> previous_;
  ScopeMode previous_mode_;
};

/// Where a tree call made now goes pending: the thread of the calling OS thread's innermost
/// ThreadScope when that scope is pending and the caller is not that thread's own job (which
/// runs calls inline); otherwise an empty target. For the tensor layer's pending tree calls.
class PendingTarget {
 public:
  explicit operator bool() const noexcept { return worker_ != nullptr; }
  /// Queues `fn()` on the target thread, as Thread::submit does. @throws as Thread::submit.
  template <class F>
  auto submit(F&& fn, c10::ArrayRef<at::Tensor> reads, c10::ArrayRef<at::Tensor> writes,
              std::string label) const
      -> Future<std::remove_cvref_t<std::invoke_result_t<std::decay_t<F>&>>> {
    using T = std::remove_cvref_t<std::invoke_result_t<std::decay_t<F>&>>;
    auto state = std::make_shared<detail::Result<T>>();
    auto task = std::make_unique<detail::TaskImpl<std::decay_t<F>, T>>(std::forward<F>(fn), state);
    detail::enqueue(*worker_, state, std::move(task), reads, writes, std::move(label));
    return Future<T>(std::move(state));
  }

 private:
  friend PendingTarget pending_target() noexcept;
  std::shared_ptr<detail::Worker> worker_;
};

/// The calling OS thread's PendingTarget (see there). One thread-local read when no scope is
/// active. Thread safety: safe from any thread.
PendingTarget pending_target() noexcept;

}  // namespace treetensor::asyncs
