#pragma once
// The calling thread's stream mode (stream.cpp; DESIGN.md §6), for the lanes that run a batch
// under the mode of the call that spawned it. Not installed.

#include "treetensor/runtime/stream.hpp"

namespace treetensor::runtime::detail {

extern thread_local bool thread_mode_set;
extern thread_local StreamMode thread_mode;

/// RAII: makes `mode` the calling thread's mode. Unlike StreamGuard it does not validate:
/// `mode` is one a caller already runs under.
class ThreadModeScope {
 public:
  explicit ThreadModeScope(const StreamMode& mode) : had_(thread_mode_set), previous_(thread_mode) {
    thread_mode_set = true;
    thread_mode = mode;
  }
  ~ThreadModeScope() {
    thread_mode_set = had_;
    thread_mode = previous_;
  }
  ThreadModeScope(const ThreadModeScope&) = delete;
  ThreadModeScope& operator=(const ThreadModeScope&) = delete;

 private:
  bool had_;
  StreamMode previous_;
};

}  // namespace treetensor::runtime::detail
