#pragma once
// The lane pool: persistent worker threads that join fork-join batches (DESIGN.md §6).
//
// A Batch is a fixed number of pieces claimed one at a time with an atomic counter, so every
// piece runs exactly once whoever claims it. The thread that submits a batch claims pieces too
// and then waits only for pieces other threads have already claimed and are running; it never
// waits on unclaimed work, so a batch submitted from inside a piece (nesting) always completes,
// at any depth and with any number of workers (including none free). A waiting caller does not
// run other batches' pieces: helping only with its own batch keeps every wait pointing at
// strictly deeper work, which rules out wait cycles.
//
// Workers spin for a short while (TREETENSOR_SPIN_US, default 50 µs) after their last piece so
// back-to-back calls skip the wake-up, then park on a condition variable (no CPU when idle).

#include <atomic>
#include <cstddef>
#include <memory>

namespace treetensor::runtime::detail {

class Batch {
 public:
  Batch(std::size_t pieces, std::size_t max_workers) : pieces_(pieces), max_workers_(max_workers) {}
  virtual ~Batch() = default;
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;

  /// Worker side: claim and run pieces until none is left, then report them with finish().
  /// `lane` is the worker's lane number (1..workers). Must not throw.
  virtual void participate(std::size_t lane) noexcept = 0;

  /// Claims the next piece; returns false when none is left.
  bool claim(std::size_t& piece) noexcept {
    piece = next_.fetch_add(1, std::memory_order_relaxed);
    return piece < pieces_;
  }
  /// Marks `n` claimed pieces as finished (their effects happen-before wait_done() returning).
  void finish(std::size_t n) noexcept;
  /// Blocks until every piece has finished: spins briefly, then sleeps.
  void wait_done() noexcept;

  bool exhausted() const noexcept { return next_.load(std::memory_order_relaxed) >= pieces_; }
  /// Admits one more worker unless max_workers already joined.
  bool admit_worker() noexcept {
    return joined_.fetch_add(1, std::memory_order_relaxed) < max_workers_;
  }
  std::size_t pieces() const noexcept { return pieces_; }
  std::size_t max_workers() const noexcept { return max_workers_; }

 private:
  const std::size_t pieces_;
  const std::size_t max_workers_;
  std::atomic<std::size_t> next_{0};
  std::atomic<std::size_t> done_{0};
  std::atomic<std::size_t> joined_{0};
};

/// Makes at least `workers` worker threads exist (capped at max_lanes - 1).
void ensure_workers(std::size_t workers);
/// Number of worker threads started so far.
std::size_t worker_count();
/// Offers `batch` to idle workers (waking up to batch->max_workers() of them). The caller must
/// then claim pieces itself, call wait_done(), and retire() the batch.
void submit(const std::shared_ptr<Batch>& batch);
/// Removes `batch` from the offer list (no-op when workers already removed it).
void retire(const Batch* batch);
/// Lane number of the calling thread: 1..workers on a lane worker, 0 elsewhere.
std::size_t current_lane() noexcept;
/// Microseconds a worker spins before parking: TREETENSOR_SPIN_US once the first tree call
/// has read it (env.hpp), 50 until then.
long spin_microseconds();
/// Reads TREETENSOR_SPIN_US (0..1000000, default 50) for spin_microseconds(); called at the
/// first tree call, where an error can be thrown (the lanes read the value where none can).
/// @throws std::invalid_argument for a bad value.
bool read_spin_from_environment();

}  // namespace treetensor::runtime::detail
