// Execution modes: process-wide setting, thread-local guard (DESIGN.md §6).
#include "treetensor/runtime/stream.hpp"

#include "runtime/thread_mode.hpp"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <thread>

namespace treetensor::runtime {
namespace {

// Process-wide mode packed into one word (kind in the low byte, lanes above) so that readers
// on the hot path do one relaxed load.
std::atomic<std::uint64_t> process_mode{std::uint64_t{1} << 8};

std::uint64_t pack(const StreamMode& m) {
  return static_cast<std::uint64_t>(m.kind) | (static_cast<std::uint64_t>(m.lanes) << 8);
}
StreamMode unpack(std::uint64_t v) {
  StreamMode m;
  m.kind = static_cast<StreamMode::Kind>(v & 0xff);
  m.lanes = static_cast<std::size_t>(v >> 8);
  return m;
}

// Read once: std::thread::hardware_concurrency() is a system call (5.6 us measured on this KVM
// machine), which a StreamGuard(automatic) around a 2 us tree call would otherwise pay each time.
std::size_t hardware_lanes() {
  static const std::size_t lanes = [] {
    const unsigned hw = std::thread::hardware_concurrency();
    return std::clamp<std::size_t>(hw == 0 ? 1 : hw, 1, max_lanes);
  }();
  return lanes;
}

}  // namespace

namespace detail {
thread_local bool thread_mode_set = false;
thread_local StreamMode thread_mode;
}  // namespace detail

StreamMode StreamMode::of(std::size_t m) {
  if (m == 0 || m > max_lanes)
    throw std::invalid_argument("treetensor::runtime::stream: lanes must be in 1.." +
                                std::to_string(max_lanes) + ", got " + std::to_string(m));
  return StreamMode{Kind::lanes, m};
}
StreamMode StreamMode::of(Automatic) {
  return StreamMode{Kind::automatic, hardware_lanes()};
}
StreamMode StreamMode::of(Fused) {
  return StreamMode{Kind::fused, 1};
}

std::string StreamMode::to_string() const {
  switch (kind) {
    case Kind::lanes:
      return "stream(" + std::to_string(lanes) + ")";
    case Kind::automatic:
      return "stream(automatic)";
    case Kind::fused:
      return "stream(fused)";
  }
  return "stream(?)";
}

void stream(std::size_t m) {
  process_mode.store(pack(StreamMode::of(m)), std::memory_order_relaxed);
}
void stream(Automatic a) {
  process_mode.store(pack(StreamMode::of(a)), std::memory_order_relaxed);
}
void stream(Fused f) {
  process_mode.store(pack(StreamMode::of(f)), std::memory_order_relaxed);
}

StreamMode current_stream_mode() {
  if (detail::thread_mode_set) return detail::thread_mode;
  return unpack(process_mode.load(std::memory_order_relaxed));
}

StreamGuard::StreamGuard(std::size_t m) : StreamGuard(StreamMode::of(m)) {}
StreamGuard::StreamGuard(Automatic a) : StreamGuard(StreamMode::of(a)) {}
StreamGuard::StreamGuard(Fused f) : StreamGuard(StreamMode::of(f)) {}
StreamGuard::StreamGuard(StreamMode mode)
    : had_previous_(detail::thread_mode_set), previous_(detail::thread_mode) {
  if (mode.kind != StreamMode::Kind::fused) (void)StreamMode::of(mode.lanes);  // validates
  detail::thread_mode_set = true;
  detail::thread_mode = mode;
}
StreamGuard::~StreamGuard() {
  detail::thread_mode_set = had_previous_;
  detail::thread_mode = previous_;
}

}  // namespace treetensor::runtime
