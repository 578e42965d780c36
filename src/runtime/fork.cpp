#include "runtime/fork.hpp"

#include <pthread.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <stdexcept>
#include <system_error>

namespace treetensor::runtime::detail {
namespace {

constexpr std::size_t kMax = 8;
std::array<std::atomic<std::mutex*>, kMax> registered{};
std::atomic<std::size_t> slots{0};

// What the forking thread locked, for its own parent and child handlers (two threads may fork
// at once: they serialise on the first mutex).
thread_local std::array<std::mutex*, kMax> locked{};
thread_local std::size_t locked_count = 0;

void lock_all() {
  locked_count = 0;
  const std::size_t n = slots.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < n && i < kMax; ++i)
    if (std::mutex* m = registered[i].load(std::memory_order_acquire)) {
      m->lock();
      locked[locked_count++] = m;
    }
}

void unlock_all() {
  while (locked_count > 0) locked[--locked_count]->unlock();
}

}  // namespace

void hold_over_fork(std::mutex& m) {
  static const int installed = [] {
    if (const int err = pthread_atfork(lock_all, unlock_all, unlock_all))
      throw std::system_error(err, std::generic_category(), "treetensor: pthread_atfork");
    return 0;
  }();
  (void)installed;
  const std::size_t i = slots.fetch_add(1, std::memory_order_acq_rel);
  if (i >= kMax) throw std::logic_error("treetensor: more than 8 mutexes held over fork()");
  registered[i].store(&m, std::memory_order_release);
}

}  // namespace treetensor::runtime::detail
