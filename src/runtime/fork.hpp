#pragma once
// Process-wide mutexes held over fork() (DESIGN.md §10, "fork()"): a child starts with only the
// forking thread, so a mutex some other thread held at the fork would stay locked there for
// ever.

#include <mutex>

namespace treetensor::runtime::detail {

/// Makes `m`, a process-wide mutex that is never destroyed, safe across fork(): the forking
/// thread locks it just before fork() and unlocks it just after, in parent and child, so the
/// child never starts with it held by a thread it does not have. Only for mutexes held briefly,
/// never while waiting for another thread or taking another lock. Call once per mutex.
/// @throws std::system_error when pthread_atfork fails; std::logic_error past 8 mutexes.
void hold_over_fork(std::mutex& m);

}  // namespace treetensor::runtime::detail
