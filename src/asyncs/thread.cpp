// asyncs threads: worker pool, job queue, futures, watchdog, synchronize (thread.hpp), and the
// hooks this layer installs on the runtime's dispatch point (DESIGN.md, layers; §10).
#include "treetensor/asyncs/thread.hpp"

#include "asyncs/internal.hpp"
#include "runtime/kernel_threads.hpp"
#include "treetensor/runtime/dispatch.hpp"
#include "treetensor/runtime/errors.hpp"
#include "treetensor/tree/internal_error.hpp"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <system_error>

namespace treetensor::asyncs {
namespace detail {
namespace {

// An environment count read once without throwing, so that the noexcept getters may read it:
// an invalid value leaves `fallback` in force and keeps its error for check_env().
template <class T>
struct EnvSetting {
  EnvSetting(const char* name, T fallback, T min, T max) : value(fallback) {
    try {
      value = static_cast<T>(parse_env_count(name, std::getenv(name), fallback, min, max));
    } catch (const std::invalid_argument& e) {
      error = e.what();
    }
  }
  std::atomic<T> value;
  std::string error;
};

EnvSetting<long long>& watchdog_setting() {
  static EnvSetting<long long> s("TREETENSOR_WATCHDOG_MS", 0, 0, 86'400'000);
  return s;
}

EnvSetting<std::size_t>& in_flight_setting() {
  static EnvSetting<std::size_t> s("TREETENSOR_ASYNCS_MAX_IN_FLIGHT", 1024, 1,
                                   std::size_t{1} << 30);
  return s;
}

// Throws the error of an invalid asyncs environment variable (the first Thread construction).
void check_env() {
  for (const std::string* error : {&watchdog_setting().error, &in_flight_setting().error})
    if (!error->empty()) throw std::invalid_argument(*error);
}

// Registered with atexit on the first unobserved job error: errors no get()/wait()/synchronize()
// observed before the process exits would otherwise vanish silently.
void report_unobserved_at_exit() {
  AsyncsState& rt = asyncs_state();
  std::lock_guard lock(rt.mu);
  auto jobs = rt.unobserved;
  std::sort(jobs.begin(), jobs.end(), [](const auto& a, const auto& b) { return a->seq < b->seq; });
  for (const auto& j : jobs) {
    try {
      std::fprintf(stderr, "treetensor: %s: error never observed: %s\n", job_context(*j).c_str(),
                   runtime::message_of(j->error).c_str());
    } catch (...) {  // an exit handler must not throw; the next error still gets its line
    }
  }
}

// The ThreadScope stack of the calling OS thread: its innermost scope's worker and mode.
std::shared_ptr<Worker>& scoped_worker() {
  thread_local std::shared_ptr<Worker> worker;
  return worker;
}
ScopeMode& scoped_mode() {
  thread_local ScopeMode mode = ScopeMode::pending;
  return mode;
}

class ActingGuard {
 public:
  explicit ActingGuard(Acting now) : saved_(acting()) { acting() = now; }
  ~ActingGuard() { acting() = saved_; }
  ActingGuard(const ActingGuard&) = delete;
  ActingGuard& operator=(const ActingGuard&) = delete;

 private:
  Acting saved_;
};

void run_job(Worker& w, Job& job) {
  ActingGuard acting_guard({&w, job.state->seq});
  try {
    at::ThreadLocalStateGuard tls(job.tls);
    runtime::StreamGuard mode(job.mode);
    // OneFlow's operand ordering: start after conflicting work submitted earlier elsewhere.
    await_keys(job.keys, acting(), job.state.get());
    block_streams(job.submitted_on, w.streams);
    job.task->run();
    job.state->finished = record_on(w.streams);
  } catch (...) {
    job.state->error = std::current_exception();
  }
  job.task.reset();  // user destructors run here: outside the lock, with the context set
}

void report_unobserved_at_exit_once() {
  static std::once_flag at_exit;
  std::call_once(at_exit, [] { std::atexit(report_unobserved_at_exit); });
}

void finish_job(AsyncsState& rt, Worker& w, Job& job) {
  unregister_operands(rt, job);
  if (job.state->error) {
    rt.unobserved.push_back(job.state);
    report_unobserved_at_exit_once();
  }
  job.state->done.store(true, std::memory_order_release);
  w.running = nullptr;
  ++w.finished;
  ++rt.finished_total;
  if (rt.progress_waiters != 0) rt.progress.notify_all();
}

// The end of a worker whose Thread was destroyed from its own job (detach_from_own_job): it
// leaves the live list and frees its id itself (caller holds AsyncsState::mu); returns the owner
// to drop once the lock is released.
std::shared_ptr<Worker> release_detached(AsyncsState& rt, Worker& w) {
  auto it =
      std::find_if(rt.live.begin(), rt.live.end(), [&](const auto& p) { return p.get() == &w; });
  TREETENSOR_INTERNAL_ASSERT(it != rt.live.end(), "a detached worker is still live");
  std::shared_ptr<Worker> self = std::move(*it);
  rt.live.erase(it);
  rt.id_taken[w.id - 1] = false;
  w.os.detach();  // nobody joins a detached worker; its std::thread dies with `self`
  return self;
}

// The job forked and this is the child, whose only thread this is: nothing is left for the
// worker to do there (its queue and state are the parent's), so the process ends.
[[noreturn]] void end_forked_child(const Worker& w, const Job& job) {
  std::fprintf(stderr,
               "treetensor asyncs: a process forked from job %llu of asyncs thread %d ends as "
               "that job returns (%s); end such a child with exec or _exit inside the job\n",
               static_cast<unsigned long long>(job.state->number), w.id,
               job.state->error ? "with an error, exit status 1" : "exit status 0");
  std::fflush(nullptr);
  _exit(job.state->error ? 1 : 0);
}

void worker_main(Worker& w) {
  install_streams(w.streams);
  if (w.kernels == KernelThreads::one) runtime::detail::pin_intra_op_to_one_thread();
  w.started.store(true, std::memory_order_release);
  w.started.notify_all();
  AsyncsState& rt = asyncs_state();
  std::shared_ptr<Worker> self;  // a detached worker's last owner: dropped after the lock
  for (;;) {
    std::unique_ptr<Job> job;
    {
      std::unique_lock lock(rt.mu);
      while (w.queue.empty() && !w.stopping) {
        w.sleeping = true;
        w.wake.wait(lock);
        w.sleeping = false;
      }
      if (w.queue.empty()) {  // stopping, and every job has run
        if (w.detached) self = release_detached(rt, w);
        return;
      }
      job = std::move(w.queue.front());
      w.queue.pop_front();
      job->started = Clock::now();
      w.running = job.get();
    }
    run_job(w, *job);
    if (w.forked) end_forked_child(w, *job);  // set only in a child, by this very thread
    {
      std::lock_guard lock(rt.mu);
      finish_job(rt, w, *job);
    }
    job.reset();  // releases the operand tensors outside the lock
  }
}

std::string describe(const std::vector<InFlightJob>& jobs) {
  std::ostringstream out;
  out << jobs.size() << " job(s) in flight";
  for (const auto& j : jobs) {
    out << "; asyncs thread " << j.thread << " job " << j.job;
    if (!j.label.empty()) out << " '" << j.label << "'";
    out << (j.running ? " running for " : " queued for ") << j.seconds << " s";
  }
  return out.str();
}

// Waits for a job that borrows its waiter's stack (a scoped tree call). On a watchdog timeout
// or a cycle of waits (WaitEdge) a job that has not started is withdrawn and the error thrown;
// a running one cannot be abandoned, so the report goes to stderr and the wait goes on.
void wait_borrowing(Worker& w, JobState& s) {
  AsyncsState& rt = asyncs_state();
  std::unique_lock lock(rt.mu);
  const auto done = [&] { return s.done.load(std::memory_order_relaxed); };
  const std::string what = "scoped tree call (" + job_context(s) + ")";
  std::optional<WaitEdge> edge;
  try {
    edge.emplace(w, what, &s);  // a cycle of waits: withdrawn like a watchdog timeout
    wait_progress(lock, done, what);
    return;
  } catch (const std::exception&) {
    auto it = std::find_if(w.queue.begin(), w.queue.end(),
                           [&](const auto& j) { return j->state.get() == &s; });
    if (it != w.queue.end()) {
      std::unique_ptr<Job> job = std::move(*it);
      w.queue.erase(it);
      unregister_operands(rt, *job);  // the registry points at it (Use)
      ++w.finished;
      s.done.store(true, std::memory_order_release);
      rt.progress.notify_all();
      lock.unlock();
      throw;
    }
    std::fprintf(stderr,
                 "treetensor asyncs watchdog: %s is running and borrows its caller: "
                 "waiting on; %s\n",
                 what.c_str(), describe(in_flight_jobs(rt)).c_str());
  }
  const ProgressWaiter waiter(rt);
  rt.progress.wait(lock, done);
}

// A path of waits from `from` to `to` in the wait-for graph (from first), or empty.
std::vector<const Worker*> wait_path(const Worker* from, const Worker* to) {
  std::vector<const Worker*> path{from};
  std::vector<std::size_t> next{0};  // per path entry: the next waits_on edge to follow
  while (!path.empty()) {
    if (path.back() == to) return path;
    const auto& edges = path.back()->waits_on;
    if (next.back() == edges.size()) {
      path.pop_back();
      next.pop_back();
      continue;
    }
    const auto [n, job] = edges[next.back()++];
    if (job != nullptr && job->done.load(std::memory_order_relaxed)) continue;  // settled
    if (std::find(path.begin(), path.end(), n) == path.end()) {
      path.push_back(n);
      next.push_back(0);
    }
  }
  return path;
}

void run_scoped(Worker& w, const runtime::LeafCall& call) {
  auto state = std::make_shared<Result<void>>();
  auto body = [&call] { runtime::run(call); };
  enqueue(w, state, std::make_unique<TaskImpl<decltype(body), void>>(body, state), {}, {},
          "tree call " + std::string(call.op));
  wait_borrowing(w, *state);
  wait_job(*state);  // joins streams, rethrows the call's error with the asyncs context
}

// Passes `call` on past this hook with each leaf run under `ctx`, so that whichever lane runs a
// leaf knows the asyncs job it belongs to.
void run_as(const runtime::LeafCall& call, Acting ctx, runtime::Proceed proceed) {
  auto leaf = [&call, ctx](std::size_t i) {
    ActingGuard g(ctx);
    call.run(i);
  };
  auto fused = [&call, ctx] {
    ActingGuard g(ctx);
    return call.fused();
  };
  runtime::LeafCall wrapped = call;
  wrapped.run = leaf;
  if (call.fused) wrapped.fused = fused;
  proceed(wrapped);
}

// Destroying a Thread from its own job cannot drain (the job would wait for itself): the worker
// is detached instead and ends on its own once its queue has run (release_detached).
void detach_from_own_job(Worker& w) {
  AsyncsState& rt = asyncs_state();
  std::lock_guard lock(rt.mu);
  std::fprintf(stderr,
               "treetensor asyncs: asyncs::Thread of asyncs thread %d destroyed from its own "
               "job %llu: detached instead of drained; it runs its %zu queued job(s), then frees "
               "its id\n",
               w.id, static_cast<unsigned long long>(w.running ? w.running->state->number : 0),
               w.queue.size());
  w.stopping = true;
  w.detached = true;
}

// The first unobserved error (in submission order) with the others listed; nothing when none.
void rethrow_unobserved(std::vector<std::shared_ptr<JobState>> errors) {
  if (errors.empty()) return;
  std::sort(errors.begin(), errors.end(),
            [](const auto& a, const auto& b) { return a->seq < b->seq; });
  std::vector<std::string> others;
  for (std::size_t i = 1; i < errors.size(); ++i)
    others.push_back(job_context(*errors[i]) + ": " + runtime::message_of(errors[i]->error));
  runtime::rethrow_with_context(errors.front()->error, job_context(*errors.front()), others);
}

// runtime::synchronize()'s part here (DESIGN.md §10): waits for every job submitted so far,
// joins the workers' streams, then reports the errors nobody observed.
void synchronize_jobs() {
  if (const auto& self = acting(); self.worker != nullptr)
    throw AsyncsUsageError(
        "treetensor asyncs: synchronize() called from asyncs thread " +
        std::to_string(self.worker->id) +
        ": it would wait for itself; get() (Python: result()) the futures you need instead");
  AsyncsState& rt = asyncs_state();
  std::unique_lock lock(rt.mu);
  std::vector<std::pair<std::shared_ptr<Worker>, std::uint64_t>> targets;
  for (const auto& w : rt.live) targets.emplace_back(w, w->submitted);
  wait_progress(
      lock,
      [&] {
        return std::all_of(targets.begin(), targets.end(),
                           [](const auto& t) { return t.first->finished >= t.second; });
      },
      "synchronize");
  std::vector<c10::Stream> streams;
  for (const auto& t : targets)
    streams.insert(streams.end(), t.first->streams.begin(), t.first->streams.end());
  auto errors = std::move(rt.unobserved);
  rt.unobserved.clear();
  lock.unlock();
  synchronize_streams(streams);
  rethrow_unobserved(std::move(errors));
}

// The runtime's registration point (DESIGN.md, layers): tree calls made inside a ThreadScope
// go to its thread; calls made by a job carry the job into the lanes that run their leaves.
bool route_call(const runtime::LeafCall& call, runtime::Proceed proceed) {
  const Acting self = acting();
  Worker* scoped = scoped_worker().get();
  if (scoped != nullptr && scoped != self.worker) {
    run_scoped(*scoped, call);
    return true;
  }
  if (self.worker == nullptr) return false;
  run_as(call, self, proceed);
  return true;
}

AsyncsState* new_state();
AsyncsState*& state_slot();

// fork() copies only the forking thread. The state is locked across it, so the child's copy is
// consistent; there the parent's workers, their queues and the state itself (with its lock and
// condition variables, which the parent's threads may have been waiting on) are left untouched
// and leaked; their jobs fail, and a fresh state takes over.
void lock_for_fork() {
  asyncs_state().mu.lock();
}
void unlock_after_fork() {
  asyncs_state().mu.unlock();
}

void lose_job(const std::shared_ptr<JobState>& job, std::vector<std::shared_ptr<JobState>>& lost) {
  JobState& s = *job;
  s.error = std::make_exception_ptr(AsyncsUsageError(
      "treetensor asyncs: " + job_context(s) +
      " was in flight when the process forked: only the forking thread exists in this child, "
      "so the job never ran here; read the results the child needs (or call synchronize()) "
      "before forking"));
  s.done.store(true, std::memory_order_release);
  lost.push_back(job);
}

void fail_forked_jobs() {
  AsyncsState& old = asyncs_state();  // locked by lock_for_fork, in this thread
  // Forked from a job: that job runs on in the child, on a thread that is no worker there.
  Worker* const forking = acting().worker;
  acting() = Acting{};
  AsyncsState* fresh = new_state();
  fresh->next_seq = old.next_seq;  // the parent's unobserved errors stay the parent's to report
  for (const auto& w : old.live) {
    w->forked = true;
    // A joinable std::thread must never be destroyed: leaked with the worker and the old state.
    if (w->running != nullptr && w.get() != forking) lose_job(w->running->state, fresh->unobserved);
    for (const auto& job : w->queue) lose_job(job->state, fresh->unobserved);
  }
  if (!fresh->unobserved.empty()) report_unobserved_at_exit_once();
  state_slot() = fresh;
}

// Installed by the first Thread: before it no job and no scope can exist, so tree calls of
// programs without asyncs threads never pay for the hook.
void install_hooks() {
  static std::once_flag once;
  std::call_once(once, [] {
    // First: when it fails, nothing is installed and the next Thread tries again.
    if (const int err = pthread_atfork(lock_for_fork, unlock_after_fork, fail_forked_jobs))
      throw std::system_error(err, std::generic_category(), "treetensor asyncs: pthread_atfork");
    runtime::add_synchronize_hook(synchronize_jobs);
    runtime::add_call_hook(route_call);
  });
}

}  // namespace

Worker::Worker(int id_, std::string name_, KernelThreads kernels_)
    : id(id_), name(std::move(name_)), kernels(kernels_), streams(pool_streams()) {}

Acting& acting() noexcept {
  thread_local Acting a;
  return a;
}

namespace {
AsyncsState* new_state() {
  auto* r = new AsyncsState();
  r->id_taken.assign(max_threads(), false);
  return r;
}

// Leaked on purpose: worker threads and futures may outlive static destruction order. A forked
// child replaces it (fail_forked_jobs).
AsyncsState*& state_slot() {
  static AsyncsState* rt = new_state();
  return rt;
}
}  // namespace

AsyncsState& asyncs_state() {
  return *state_slot();
}

std::string job_context(const JobState& job) {
  std::string text =
      "asyncs thread " + std::to_string(job.thread) + ", job " + std::to_string(job.number);
  if (!job.label.empty()) text += " '" + job.label + "'";
  return text;
}

std::vector<InFlightJob> in_flight_jobs(const AsyncsState& rt) {
  const auto now = Clock::now();
  const auto since = [&](Clock::time_point t) {
    return std::chrono::duration<double>(now - t).count();
  };
  std::vector<InFlightJob> jobs;
  for (const auto& w : rt.live) {
    if (w->running != nullptr) {
      const auto& s = *w->running->state;
      jobs.push_back({w->id, s.number, s.label, true, since(w->running->started)});
    }
    for (const auto& j : w->queue)
      jobs.push_back({w->id, j->state->number, j->state->label, false, since(j->submitted)});
  }
  return jobs;
}

void throw_watchdog(const AsyncsState& rt, std::string_view what,
                    std::chrono::milliseconds timeout) {
  auto jobs = in_flight_jobs(rt);
  const std::string text = "treetensor asyncs watchdog: " + std::string(what) +
                           " made no progress for " + std::to_string(timeout.count()) +
                           " ms (TREETENSOR_WATCHDOG_MS); " + describe(jobs);
  throw WatchdogTimeout(text, std::move(jobs));
}

WaitEdge::WaitEdge(const Worker& target, std::string_view what, const JobState* job) {
  Worker* self = acting().worker;
  if (self == nullptr) return;  // only workers can be waited for: no cycle through this one
  const auto cycle = wait_path(&target, self);
  if (!cycle.empty()) {
    std::string chain = "asyncs thread " + std::to_string(self->id);
    for (const Worker* w : cycle) chain += " -> asyncs thread " + std::to_string(w->id);
    throw AsyncsUsageError("treetensor asyncs: " + std::string(what) + " from asyncs thread " +
                           std::to_string(self->id) + " would close a cycle of waits (" + chain +
                           "): each waits for work queued behind the other's, so none could "
                           "ever finish");
  }
  from_ = self;
  to_ = {&target, job};
  self->waits_on.push_back(to_);
}

WaitEdge::~WaitEdge() {
  if (from_ == nullptr) return;
  auto& v = from_->waits_on;
  v.erase(std::find(v.begin(), v.end(), to_));
}

void throw_forked(const Worker& w) {
  throw AsyncsUsageError("treetensor asyncs: asyncs thread " + std::to_string(w.id) +
                         " was started before this process forked; its OS thread exists only "
                         "in the parent: start a new asyncs thread in the child");
}

void enqueue(Worker& w, std::shared_ptr<JobState> state, std::unique_ptr<Task> task,
             c10::ArrayRef<at::Tensor> reads, c10::ArrayRef<at::Tensor> writes, std::string label) {
  auto job = std::make_unique<Job>();  // captures the submitter's thread-local state
  job->keys = operand_keys(reads, writes, &job->operands);
  job->submitted_on = record_submitter(job->operands, w.streams);
  job->submitted = Clock::now();
  const Acting self = acting();
  state->thread = w.id;
  state->label = std::move(label);
  state->submitter = self.seq;
  job->state = std::move(state);
  job->task = std::move(task);

  AsyncsState& rt = asyncs_state();
  std::unique_lock lock(rt.mu);
  if (w.forked) throw_forked(w);
  // The worker's own jobs never wait for back-pressure: the queue cannot drain meanwhile.
  if (self.worker != &w) {
    wait_progress(
        lock, [&] { return w.stopping || w.submitted - w.finished < max_in_flight(); },
        "submit (back-pressure)");
  }
  if (w.stopping)
    throw AsyncsUsageError("treetensor asyncs: submit to asyncs thread " + std::to_string(w.id) +
                           " after its Thread was destroyed");
  job->state->number = ++w.submitted;
  job->state->seq = rt.next_seq++;
  register_operands(rt, *job);
  w.queue.push_back(std::move(job));
  const bool wake = w.sleeping;
  lock.unlock();
  if (wake) w.wake.notify_one();
}

bool wait_job_for(const JobState& s, std::chrono::milliseconds timeout) {
  if (s.done.load(std::memory_order_acquire)) return true;
  AsyncsState& rt = asyncs_state();
  std::unique_lock lock(rt.mu);
  const ProgressWaiter waiter(rt);
  return rt.progress.wait_for(lock, timeout,
                              [&] { return s.done.load(std::memory_order_relaxed); });
}

void wait_job(JobState& s) {
  if (!s.done.load(std::memory_order_acquire)) {
    const Acting self = acting();
    if (self.worker != nullptr && self.worker->id == s.thread)
      throw AsyncsUsageError("treetensor asyncs: waiting from asyncs thread " +
                             std::to_string(s.thread) + " for its own " + job_context(s) +
                             ", which is queued behind the calling job: it would deadlock");
    AsyncsState& rt = asyncs_state();
    std::unique_lock lock(rt.mu);
    const std::string what = "Future::wait for " + job_context(s);
    const auto target = std::find_if(rt.live.begin(), rt.live.end(),
                                     [&](const auto& w) { return w->id == s.thread; });
    std::optional<WaitEdge> edge;
    if (target != rt.live.end() && !s.done.load(std::memory_order_relaxed))
      edge.emplace(**target, what, &s);
    wait_progress(
        lock, [&] { return s.done.load(std::memory_order_relaxed); }, what);
  }
  block_current(s.finished);
  if (!s.error) return;
  {
    AsyncsState& rt = asyncs_state();
    std::lock_guard lock(rt.mu);
    auto& u = rt.unobserved;
    u.erase(std::remove_if(u.begin(), u.end(), [&](const auto& j) { return j.get() == &s; }),
            u.end());
  }
  runtime::rethrow_with_context(s.error, job_context(s));
}

}  // namespace detail

using detail::asyncs_state;
using detail::AsyncsState;
using detail::Worker;

std::size_t max_threads() {
  static const std::size_t n = detail::parse_env_count(
      "TREETENSOR_ASYNCS_THREADS", std::getenv("TREETENSOR_ASYNCS_THREADS"), 8, 1, 1024);
  return n;
}

void set_watchdog_timeout(std::chrono::milliseconds timeout) {
  if (timeout.count() < 0)
    throw std::invalid_argument("treetensor asyncs: watchdog timeout must be >= 0 ms, got " +
                                std::to_string(timeout.count()));
  detail::watchdog_setting().value.store(timeout.count(), std::memory_order_relaxed);
}

std::chrono::milliseconds watchdog_timeout() noexcept {
  return std::chrono::milliseconds(
      detail::watchdog_setting().value.load(std::memory_order_relaxed));
}

void set_max_in_flight(std::size_t jobs) {
  if (jobs == 0) throw std::invalid_argument("treetensor asyncs: max_in_flight must be >= 1");
  detail::in_flight_setting().value.store(jobs, std::memory_order_relaxed);
}

std::size_t max_in_flight() noexcept {
  return detail::in_flight_setting().value.load(std::memory_order_relaxed);
}

std::optional<int> current_thread_id() noexcept {
  const auto& a = detail::acting();
  if (a.worker == nullptr) return std::nullopt;
  return a.worker->id;
}

bool routes_calls() noexcept {
  return detail::scoped_worker() != nullptr || detail::acting().worker != nullptr;
}

// --- Thread ----------------------------------------------------------------------------------

Thread::Thread(std::string name, KernelThreads kernels) {
  detail::check_env();
  detail::install_hooks();
  AsyncsState& rt = asyncs_state();
  int id = 0;
  {
    std::lock_guard lock(rt.mu);
    const auto free = std::find(rt.id_taken.begin(), rt.id_taken.end(), false);
    if (free == rt.id_taken.end())
      throw ThreadPoolExhausted(
          "treetensor asyncs: all " + std::to_string(rt.id_taken.size()) +
          " worker ids are taken (pool size from TREETENSOR_ASYNCS_THREADS); destroy an "
          "asyncs::Thread first (close() in Python; int-named Python workers stay) or raise the "
          "limit");
    *free = true;
    id = static_cast<int>(free - rt.id_taken.begin()) + 1;
  }
  try {
    worker_ = std::make_shared<Worker>(id, std::move(name), kernels);
    worker_->os = std::thread(detail::worker_main, std::ref(*worker_));
    worker_->started.wait(false, std::memory_order_acquire);
  } catch (...) {
    std::lock_guard lock(rt.mu);
    rt.id_taken[id - 1] = false;
    throw;
  }
  std::lock_guard lock(rt.mu);
  rt.live.push_back(worker_);
}

Thread::Thread(Thread&& other) noexcept
    : worker_(std::move(other.worker_)), closed_id_(std::exchange(other.closed_id_, 0)) {}

Thread::~Thread() {
  if (worker_) close();
}

void Thread::close() {
  if (closed()) return;
  if (worker_ && worker_->forked) {  // nothing to drain or join in this child: see fork()
    closed_id_ = worker_->id;
    worker_.reset();
    return;
  }
  Worker& w = worker();
  closed_id_ = w.id;
  // The Worker stays alive for futures, scopes and the live list; this Thread lets go of it.
  const std::shared_ptr<Worker> held = std::move(worker_);
  if (detail::acting().worker == &w) {
    detail::detach_from_own_job(w);
    return;
  }
  AsyncsState& rt = asyncs_state();
  std::unique_lock lock(rt.mu);
  // Drain: a destructor cannot throw, so the watchdog only reports on stderr here.
  const auto drained = [&] { return w.finished == w.submitted; };
  const detail::ProgressWaiter waiter(rt);
  while (!drained()) {
    const auto timeout = watchdog_timeout();
    if (timeout.count() == 0) {
      rt.progress.wait(lock, drained);
      break;
    }
    const auto seen = rt.finished_total;
    if (!rt.progress.wait_for(lock, timeout,
                              [&] { return drained() || rt.finished_total != seen; }))
      std::fprintf(stderr, "treetensor asyncs watchdog: ~Thread of asyncs thread %d waits; %s\n",
                   w.id, detail::describe(detail::in_flight_jobs(rt)).c_str());
  }
  w.stopping = true;
  lock.unlock();
  w.wake.notify_one();
  w.os.join();
  lock.lock();
  rt.live.erase(std::find(rt.live.begin(), rt.live.end(), held));
  rt.id_taken[w.id - 1] = false;
}

detail::Worker& Thread::worker() const {
  if (closed())
    throw AsyncsUsageError("treetensor asyncs: asyncs thread " + std::to_string(closed_id_) +
                           " is closed: cannot schedule new jobs after close()");
  if (!worker_) throw AsyncsUsageError("treetensor asyncs: use of a moved-from asyncs::Thread");
  if (worker_->forked) detail::throw_forked(*worker_);
  return *worker_;
}

int Thread::id() const {
  return closed() ? closed_id_ : worker().id;
}

std::size_t Thread::in_flight() const {
  if (closed()) return 0;
  Worker& w = worker();
  std::lock_guard lock(asyncs_state().mu);
  return w.submitted - w.finished;
}

void Thread::wait_idle() const {
  if (closed()) return;
  Worker& w = worker();
  if (detail::acting().worker == &w)
    throw AsyncsUsageError("treetensor asyncs: wait_idle() of asyncs thread " +
                           std::to_string(w.id) + " called from its own job: it would deadlock");
  std::unique_lock lock(asyncs_state().mu);
  const auto target = w.submitted;
  const std::string what = "wait_idle of asyncs thread " + std::to_string(w.id);
  const detail::WaitEdge edge(w, what);
  detail::wait_progress(
      lock, [&] { return w.finished >= target; }, what);
}

WorkMark Thread::mark() const {
  WorkMark m;
  if (closed()) return m;
  Worker& w = worker();
  std::lock_guard lock(asyncs_state().mu);
  m.targets_.emplace_back(worker_, w.submitted);
  return m;
}

WorkMark mark_all() {
  WorkMark m;
  AsyncsState& rt = asyncs_state();
  std::lock_guard lock(rt.mu);
  for (const auto& w : rt.live) m.targets_.emplace_back(w, w->submitted);
  return m;
}

bool WorkMark::wait_for(std::chrono::milliseconds timeout) const {
  AsyncsState& rt = asyncs_state();
  std::unique_lock lock(rt.mu);
  const detail::ProgressWaiter waiter(rt);
  return rt.progress.wait_for(lock, timeout, [&] {
    return std::all_of(targets_.begin(), targets_.end(),
                       [](const auto& t) { return t.first->finished >= t.second; });
  });
}

// --- ThreadScope -----------------------------------------------------------------------------

ThreadScope::ThreadScope(const Thread& thread, ScopeMode mode)
    : previous_(detail::scoped_worker()), previous_mode_(detail::scoped_mode()) {
  thread.worker();  // throws on a moved-from or closed Thread
  detail::scoped_worker() = thread.worker_;
  detail::scoped_mode() = mode;
}

ThreadScope::~ThreadScope() {
  detail::scoped_worker() = std::move(previous_);
  detail::scoped_mode() = previous_mode_;
}

PendingTarget pending_target() noexcept {
  PendingTarget t;
  const std::shared_ptr<Worker>& w = detail::scoped_worker();
  if (w && detail::scoped_mode() == ScopeMode::pending && w.get() != detail::acting().worker)
    t.worker_ = w;
  return t;
}

}  // namespace treetensor::asyncs
