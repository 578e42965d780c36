#pragma once
// Execution modes of tree calls: linear, stream(M) lanes, automatic, fused (DESIGN.md §5, §6,
// §8, §9), the scoped guard, and the inspectable policy decision.
//
// Modes (what runtime::run() does with one LeafCall):
//  - stream(1)          linear: every leaf on the calling thread, in leaf order. The default.
//  - stream(M), M > 1   M lanes: the calling thread plus up to M-1 persistent worker threads
//                       share the leaves (treetensor parity: DI-treetensor's `stream(n)`;
//                       unlike it, the caller takes part and all device streams are synchronised).
//  - stream(automatic)  per call, the policy picks linear, lanes or fused (see explain() in
//                       dispatch.hpp):
//                       calls whose estimated work (LeafCall::cost at calibrated flop/byte
//                       rates) is under 3 hand-off round trips stay linear; other call shapes
//                       (op, device, dtype, leaf-count and cost buckets) are timed under each
//                       strategy twice, then the fastest is kept (a rival must beat linear by
//                       3%), with one re-check every 64 calls. The one-time calibration
//                       (hand-off round trip, op dispatch, flop and copy rates) takes ~6 ms at
//                       the first automatic call. On devices with streams, times are host times.
//  - stream(fused)      the call's batched form (LeafCall::fused) when it has one and it accepts
//                       the leaves; otherwise linear. Meant for tests and benchmarks.
//  - TREETENSOR_INLINE=1 (environment, read once at first use): every call runs linearly on the
//                       caller whatever the mode — the single-threaded debug mode.
//  - TREETENSOR_LOG_POLICY=1: every automatic decision prints one line to stderr.
// Values never depend on the mode (bitwise for deterministic kernels, DESIGN.md §5).
//
// Inside lanes (M > 1):
//  - leaves are split into contiguous ranges of about equal LeafCost (4 per lane), claimed one
//    at a time, so every leaf runs exactly once and a late or slow lane simply takes fewer;
//  - each leaf's kernel runs with one intra-op thread (the lane's own OpenMP setting, never the
//    process-wide at::set_num_threads) and one BLAS thread (OpenBLAS's count is global: it is 1
//    while any parallel tree call is in flight and restored after the last one);
//  - the caller's thread-local state is carried in (at::ThreadLocalState: grad mode, inference
//    mode, autocast, dispatch keys) as is its stream mode, so nested tree calls follow it;
//  - a tree call made from a leaf (nesting, any depth) never deadlocks: a caller waits only for
//    ranges other threads have claimed and are running, and runs all unclaimed ones itself;
//  - workers spin ~50 µs (TREETENSOR_SPIN_US) after their last range, then sleep (no CPU);
//  - on devices with streams, see device_streams.hpp; errors: see run() in dispatch.hpp.

#include <cstddef>
#include <string>

namespace treetensor::runtime {

/// Tag for stream(automatic).
struct Automatic {};
inline constexpr Automatic automatic{};
/// Tag for stream(fused).
struct Fused {};
inline constexpr Fused fused{};

/// An execution mode: linear/lanes (kind lanes, M = lanes), automatic, or fused.
/// Build one with StreamMode::of(...); compare with ==.
struct StreamMode {
  enum class Kind { lanes, automatic, fused };
  Kind kind = Kind::lanes;
  std::size_t lanes = 1;  ///< M for Kind::lanes; the lane budget for Kind::automatic

  static StreamMode of(std::size_t m);  ///< throws std::invalid_argument when m is 0 or > 64
  static StreamMode of(Automatic);
  static StreamMode of(Fused);
  friend bool operator==(const StreamMode&, const StreamMode&) = default;
  std::string to_string() const;  ///< "stream(2)", "stream(automatic)", "stream(fused)"
};

/// Largest M accepted by stream(M).
inline constexpr std::size_t max_lanes = 64;

/// Sets the process-wide mode (treetensor parity: `ttorch.stream(n)`).
/// @param m  number of lanes, 1..max_lanes; 1 is linear.
/// @throws std::invalid_argument when m is 0 or above max_lanes.
/// Thread safety: thread-safe; calls already running keep the mode they started with. A
/// StreamGuard on a thread takes precedence over the process-wide mode on that thread.
void stream(std::size_t m);
/// Sets the process-wide mode to automatic; the lane budget is the machine's hardware threads.
/// Thread safety: as stream(m).
void stream(Automatic);
/// Sets the process-wide mode to fused (for tests and benchmarks; see the file comment).
/// Thread safety: as stream(m).
void stream(Fused);

/// The mode that run() uses on this thread now: the innermost StreamGuard's, else the
/// process-wide one. Inside a lane this is the mode of the call that spawned the leaf work.
/// Thread safety: thread-safe.
StreamMode current_stream_mode();

/// Scoped mode for the calling thread (and for the lanes running its tree calls); restores the
/// previous thread-local mode when destroyed. Guards nest; the innermost wins.
/// Example: `{ runtime::StreamGuard g(2); tree_op(...); }  // two lanes inside the block`
/// Thread safety: affects only the constructing thread; destroy it on that thread.
class StreamGuard {
 public:
  explicit StreamGuard(std::size_t m);  ///< throws like stream(m)
  explicit StreamGuard(Automatic);
  explicit StreamGuard(Fused);
  explicit StreamGuard(StreamMode mode);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  bool had_previous_;
  StreamMode previous_;
};

}  // namespace treetensor::runtime
