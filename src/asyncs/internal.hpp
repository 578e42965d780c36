#pragma once
// Internals shared by thread.cpp, operands.cpp and streams.cpp of the asyncs layer (not
// installed).
//
// One process-wide lock (AsyncsState::mu) guards every queue, counter and the operand registry:
// asyncs jobs are coarse (metric writing, data decoding), so one lock keeps the reasoning about
// deadlocks simple at no measurable cost. Jobs never run under it.

#include "runtime/env.hpp"
#include "treetensor/asyncs/thread.hpp"
#include "treetensor/runtime/stream.hpp"

#include <ATen/ThreadLocalState.h>
#include <c10/core/Stream.h>
#include <c10/util/SmallVector.h>
#include <c10/util/flat_hash_map.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace treetensor::asyncs::detail {

using Clock = std::chrono::steady_clock;

/// One registered operand of a pending job: its storage key and whether the job writes it.
struct OperandKey {
  const void* key = nullptr;
  bool write = false;
};

struct Job {
  std::shared_ptr<JobState> state;
  std::unique_ptr<Task> task;
  at::ThreadLocalState tls;  // the submitter's, installed around the job
  runtime::StreamMode mode =
      runtime::current_stream_mode();    // the submitter's stream(M) mode, likewise
  std::vector<at::Tensor> operands;      // kept alive until the job has finished
  std::vector<OperandKey> keys;          // deduplicated; write wins over read
  std::vector<c10::Event> submitted_on;  // CUDA: recorded on the submitter's current streams
  Clock::time_point submitted, started;
};

class Worker {
 public:
  Worker(int id, std::string name, KernelThreads kernels);
  const int id;
  const std::string name;
  const KernelThreads kernels;
  const std::vector<c10::Stream> streams;  // CUDA: one pool stream per device; else empty
  // Guarded by AsyncsState::mu:
  std::deque<std::unique_ptr<Job>> queue;
  Job* running = nullptr;
  std::uint64_t submitted = 0;
  std::uint64_t finished = 0;
  bool stopping = false;
  bool sleeping = false;  // waiting on `wake`: only then does a submit pay for a notify
  bool detached = false;  // its Thread was destroyed from its own job: it ends on its own
  // Set in a forked child (by the only thread there) for the parent's workers, whose OS threads
  // do not exist in it: they refuse work and are never joined or destroyed.
  bool forked = false;
  // Workers whose work this worker's running job (or a lane running its leaves) is blocked on,
  // one entry per blocked wait, with the awaited job (null: all of that worker's work): the
  // wait-for graph WaitEdge checks for cycles.
  std::vector<std::pair<const Worker*, const JobState*>> waits_on;
  std::condition_variable wake;
  // Set once the worker is past its start-up (which initialises the kernel libraries' thread
  // settings): Thread's constructor waits for it, so a fork() after it never copies a library
  // lock that this start-up held (MKL's, for one), which would hang the child's first worker.
  std::atomic<bool> started{false};
  // Started by Thread's constructor, joined by its destructor.
  std::thread os;
};

/// @throws AsyncsUsageError: `w` is a worker of the parent process (Worker::forked).
[[noreturn]] void throw_forked(const Worker& w);

using runtime::detail::parse_env_count;  // runtime/env.hpp

/// What the calling OS thread is doing for the asyncs runtime: running job `seq` of `worker`
/// (on the worker itself, or in a lane running a leaf of a tree call that job made).
struct Acting {
  Worker* worker = nullptr;
  std::uint64_t seq = 0;
};
Acting& acting() noexcept;

/// A pending job's use of one operand key. A plain pointer: a job's uses are removed
/// (unregister_operands) before its Job, which owns a reference to its state, is dropped.
struct Use {
  JobState* job = nullptr;
  bool write = false;
};
/// The operand registry: storage key -> the uses of the jobs pending on it. A flat table with
/// the first uses inline, so registering a key costs no allocation per key (a tree call
/// registers one per leaf).
using UseMap = ska::flat_hash_map<const void*, c10::SmallVector<Use, 2>>;

struct AsyncsState {
  std::mutex mu;
  std::condition_variable progress;  // notified when a job finishes and someone waits
  std::size_t progress_waiters = 0;  // threads blocked on `progress`
  std::uint64_t finished_total = 0;  // progress counter for the watchdog
  std::uint64_t next_seq = 1;
  std::vector<bool> id_taken;                         // index id-1
  std::vector<std::shared_ptr<Worker>> live;          // workers of live Thread objects
  std::vector<std::shared_ptr<JobState>> unobserved;  // failed jobs no one has waited for
  UseMap uses;                                        // operand registry
};
AsyncsState& asyncs_state();

/// Lists the jobs in flight on every live worker (caller holds AsyncsState::mu).
std::vector<InFlightJob> in_flight_jobs(const AsyncsState& rt);
/// "asyncs thread 2, job 7 'label'".
std::string job_context(const JobState& job);

/// Counts the caller among AsyncsState::progress_waiters while it lives (caller holds
/// AsyncsState::mu).
class ProgressWaiter {
 public:
  explicit ProgressWaiter(AsyncsState& rt) : rt_(rt) { ++rt_.progress_waiters; }
  ~ProgressWaiter() { --rt_.progress_waiters; }
  ProgressWaiter(const ProgressWaiter&) = delete;
  ProgressWaiter& operator=(const ProgressWaiter&) = delete;

 private:
  AsyncsState& rt_;
};

/// One blocked wait of the calling thread's asyncs worker (if it is one) for work queued on
/// `target`, in the wait-for graph while it lives. A wait that would close a cycle (target
/// waits, through any chain of workers, for the caller's worker) could never end: it is
/// refused when it starts. Caller holds AsyncsState::mu for the edge's whole life.
/// @throws AsyncsUsageError naming the chain of workers and `what`.
class WaitEdge {
 public:
  /// `job`: the awaited job on `target`, or null for all of its work (wait_idle). An edge
  /// whose job has finished is settled (its waiter is about to wake) and closes no cycle.
  WaitEdge(const Worker& target, std::string_view what, const JobState* job = nullptr);
  ~WaitEdge();
  WaitEdge(const WaitEdge&) = delete;
  WaitEdge& operator=(const WaitEdge&) = delete;

 private:
  Worker* from_ = nullptr;
  std::pair<const Worker*, const JobState*> to_{nullptr, nullptr};
};

/// Blocks on AsyncsState::progress until `done()` (caller holds `lock` on AsyncsState::mu). With
/// the watchdog on, throws WatchdogTimeout naming `what` when no job finishes for the timeout.
template <class Pred>
void wait_progress(std::unique_lock<std::mutex>& lock, Pred done, std::string_view what);
[[noreturn]] void throw_watchdog(const AsyncsState& rt, std::string_view what,
                                 std::chrono::milliseconds timeout);

template <class Pred>
void wait_progress(std::unique_lock<std::mutex>& lock, Pred done, std::string_view what) {
  AsyncsState& rt = asyncs_state();
  const auto timeout = watchdog_timeout();
  const ProgressWaiter waiter(rt);
  if (timeout.count() == 0) {
    rt.progress.wait(lock, done);
    return;
  }
  std::uint64_t seen = rt.finished_total;
  auto deadline = Clock::now() + timeout;
  while (!done()) {
    const bool timed_out = rt.progress.wait_until(lock, deadline) == std::cv_status::timeout;
    if (rt.finished_total != seen) {
      seen = rt.finished_total;
      deadline = Clock::now() + timeout;
    } else if (timed_out && !done()) {
      throw_watchdog(rt, what, timeout);
    }
  }
}

// --- operand tracking (operands.cpp); registry functions need AsyncsState::mu held ---------
/// Keys of `reads` and `writes`, deduplicated, write winning; fills `keep` with the tensors.
std::vector<OperandKey> operand_keys(c10::ArrayRef<at::Tensor> reads,
                                     c10::ArrayRef<at::Tensor> writes,
                                     std::vector<at::Tensor>* keep);
void register_operands(AsyncsState& rt, const Job& job);
void unregister_operands(AsyncsState& rt, const Job& job);
/// Waits for the pending jobs that conflict with `keys` (await_operands' rule, seen from
/// `self`); then the caller's current streams wait for theirs. `job`, when not null, is the
/// job about to start (named in a watchdog report). Takes AsyncsState::mu itself.
void await_keys(const std::vector<OperandKey>& keys, const Acting& self, const JobState* job);

// --- device streams (streams.cpp); all no-ops without CUDA devices -----------------------
std::vector<c10::Stream> pool_streams();
/// Makes `streams` the calling OS thread's current streams.
void install_streams(const std::vector<c10::Stream>& streams);
/// Events recorded on the caller's current streams of the devices of `tensors`; also marks
/// their memory as used on the worker's stream of that device (caching allocator).
std::vector<c10::Event> record_submitter(const std::vector<at::Tensor>& tensors,
                                         const std::vector<c10::Stream>& worker_streams);
/// Makes `streams` wait for `events` (device-side).
void block_streams(const std::vector<c10::Event>& events, const std::vector<c10::Stream>& streams);
/// One event recorded on each of `streams` (a job's end, for the caller to wait on).
std::vector<c10::Event> record_on(const std::vector<c10::Stream>& streams);
/// Makes the caller's current streams wait for `events` (device-side).
void block_current(const std::vector<c10::Event>& events);
/// Host waits for `streams` and the caller's current streams.
void synchronize_streams(const std::vector<c10::Stream>& streams);

}  // namespace treetensor::asyncs::detail
