#include "runtime/lanes.hpp"

#include "runtime/env.hpp"
#include "runtime/kernel_threads.hpp"
#include "treetensor/runtime/stream.hpp"

#include <pthread.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace treetensor::runtime::detail {
namespace {

using Clock = std::chrono::steady_clock;

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

thread_local std::size_t this_lane = 0;

// Process-wide pool state. Deliberately leaked: workers park forever and the process may exit
// at any time without joining them (no static-destruction-order hazards with LibTorch).
struct Pool {
  std::mutex mutex;
  std::condition_variable wake;
  std::vector<std::shared_ptr<Batch>> offers;  // batches that may still have unclaimed pieces
  std::atomic<std::size_t> offer_count{0};     // offers.size(), read without the lock by spinners
  std::size_t sleepers = 0;
  std::atomic<std::size_t> workers{0};
  // Workers past their start-up (which calls into LibTorch): ensure_workers() waits for it, so
  // no worker is still inside LibTorch's initialisation when the process exits.
  std::atomic<std::size_t> started{0};

  // Under `mutex`: first offer that still has pieces and room for one more worker; drops
  // exhausted offers on the way.
  std::shared_ptr<Batch> pick_locked() {
    for (std::size_t i = 0; i < offers.size();) {
      if (offers[i]->exhausted()) {
        offers.erase(offers.begin() + static_cast<std::ptrdiff_t>(i));
        continue;
      }
      if (offers[i]->admit_worker()) return offers[i];
      ++i;
    }
    return nullptr;
  }

  std::shared_ptr<Batch> next_batch() {
    const auto spin_until = Clock::now() + std::chrono::microseconds(spin_microseconds());
    for (;;) {
      // Spin: a batch offered now is picked up without a futex wake.
      while (offer_count.load(std::memory_order_acquire) == 0 && Clock::now() < spin_until)
        cpu_relax();
      std::unique_lock lock(mutex);
      if (auto batch = pick_locked()) {
        offer_count.store(offers.size(), std::memory_order_release);
        return batch;
      }
      offer_count.store(offers.size(), std::memory_order_release);
      if (Clock::now() < spin_until) continue;
      ++sleepers;
      wake.wait(lock);
      --sleepers;
    }
  }

  void worker_main(std::size_t lane) {
    this_lane = lane;
    pin_intra_op_to_one_thread();
    started.fetch_add(1, std::memory_order_release);
    started.notify_all();
    for (;;) next_batch()->participate(lane);
  }
};

// A forked child has none of the parent's workers (only the forking thread is copied): it
// starts a fresh pool, whose workers are made on demand, and leaks the parent's, whose lock and
// condition variable the parent's threads may have held or waited on. The child's handler
// writes the pointer itself: a static's initialisation guard, held by a thread the child does
// not have, would hang it.
std::atomic<Pool*> the_pool{nullptr};
std::once_flag pool_made;

Pool& pool() {
  if (Pool* p = the_pool.load(std::memory_order_acquire)) return *p;
  std::call_once(pool_made, [] {
    if (const int err = pthread_atfork(nullptr, nullptr,
                                       [] { the_pool.store(new Pool, std::memory_order_relaxed); }))
      throw std::system_error(err, std::generic_category(), "treetensor lanes: pthread_atfork");
    the_pool.store(new Pool, std::memory_order_release);
  });
  return *the_pool.load(std::memory_order_acquire);
}

}  // namespace

void Batch::finish(std::size_t n) noexcept {
  if (n == 0) return;
  if (done_.fetch_add(n, std::memory_order_acq_rel) + n == pieces_) done_.notify_all();
}

void Batch::wait_done() noexcept {
  std::size_t seen = done_.load(std::memory_order_acquire);
  if (seen == pieces_) return;
  const auto spin_until = Clock::now() + std::chrono::microseconds(spin_microseconds());
  while (Clock::now() < spin_until) {
    for (int i = 0; i < 64; ++i) cpu_relax();
    seen = done_.load(std::memory_order_acquire);
    if (seen == pieces_) return;
  }
  while ((seen = done_.load(std::memory_order_acquire)) != pieces_) done_.wait(seen);
}

namespace {
std::atomic<long> spin_us{50};  // TREETENSOR_SPIN_US once the first tree call has read it
}  // namespace

long spin_microseconds() {
  return spin_us.load(std::memory_order_relaxed);
}

bool read_spin_from_environment() {
  spin_us.store(long(parse_env_count("TREETENSOR_SPIN_US", std::getenv("TREETENSOR_SPIN_US"), 50, 0,
                                     1'000'000)),
                std::memory_order_relaxed);
  return true;
}

void ensure_workers(std::size_t wanted) {
  Pool& p = pool();
  wanted = std::min(wanted, max_lanes - 1);
  if (p.started.load(std::memory_order_acquire) >= wanted) return;
  std::lock_guard lock(p.mutex);
  for (std::size_t n = p.workers.load(); n < wanted; ++n) {
    std::thread([&p, lane = n + 1] { p.worker_main(lane); }).detach();
    p.workers.store(n + 1, std::memory_order_release);
  }
  for (std::size_t n; (n = p.started.load(std::memory_order_acquire)) < wanted;)
    p.started.wait(n, std::memory_order_acquire);
}

std::size_t worker_count() {
  return pool().workers.load(std::memory_order_acquire);
}

void submit(const std::shared_ptr<Batch>& batch) {
  Pool& p = pool();
  std::size_t to_wake = 0;
  {
    std::lock_guard lock(p.mutex);
    p.offers.push_back(batch);
    p.offer_count.store(p.offers.size(), std::memory_order_release);
    to_wake = std::min(p.sleepers, std::min(batch->max_workers(), batch->pieces()));
  }
  for (std::size_t i = 0; i < to_wake; ++i) p.wake.notify_one();
}

void retire(const Batch* batch) {
  Pool& p = pool();
  std::lock_guard lock(p.mutex);
  for (auto it = p.offers.begin(); it != p.offers.end(); ++it) {
    if (it->get() == batch) {
      p.offers.erase(it);
      break;
    }
  }
  p.offer_count.store(p.offers.size(), std::memory_order_release);
}

std::size_t current_lane() noexcept {
  return this_lane;
}

}  // namespace treetensor::runtime::detail
