#pragma once
// Side-by-side timing: every strategy runs once per repetition, round-robin, so that noise
// from a shared machine falls on all of them alike.

#include <c10/core/Device.h>

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace treetensor::bench {

/// One strategy under measurement.
struct Candidate {
  std::string name;
  /// One repetition. Keeps what it produced (as a caller would) until `release`.
  std::function<void()> run;
  /// Drops what `run` kept; called after the clock stops. May be empty.
  std::function<void()> release;
};

/// Mean and sample standard deviation of the timed repetitions, in milliseconds.
struct Timing {
  double mean_ms = 0;
  double std_ms = 0;
};

/// What time_round_robin() measured: one Timing per candidate, the repetitions used and each
/// candidate's calls per timed sample (RepPlan::min_sample_ms; 1 when not batched).
struct RoundRobin {
  std::vector<Timing> timings;
  std::size_t reps = 0;
  std::vector<std::size_t> calls;
};

/// A progress line on stderr: rewritten in place on a terminal; elsewhere one line per stage.
class Progress {
 public:
  explicit Progress(bool enabled);
  ~Progress();
  /// Shows "<stage>: <detail>"; when stderr is not a terminal, prints only new stages.
  void update(const std::string& stage, const std::string& detail);
  /// Erases the line (terminal) so that stdout output starts on a clean line.
  void clear();

 private:
  bool enabled_;
  bool tty_;
  std::string last_stage_;
};

/// Waits until all work queued on `device` is done: a no-op on CPU; on CUDA
/// cudaDeviceSynchronize (found at run time, so this builds without CUDA headers), else a
/// synchronize of the device's current stream (where the runtime joins all lane streams).
std::function<void()> device_synchronizer(c10::Device device);

/// How many timed repetitions: `fixed` when non-zero, else as many as fit in `budget_s`
/// seconds at the pace of the last warm-up repetition, clamped to [min_reps, max_reps].
struct RepPlan {
  std::size_t warmup = 2;
  std::size_t fixed = 0;
  double budget_s = 6.0;
  std::size_t min_reps = 10, max_reps = 100;
  /// Automatic plans only, when non-zero: once a warm-up round alone takes longer than
  /// budget_s, warm-up stops after 2 rounds and T is at least slow_min_reps instead of min_reps
  /// (sizes whose every round takes seconds would otherwise take minutes).
  std::size_t slow_min_reps = 0;
  /// When non-zero: each timed sample of a candidate is the mean of k back-to-back runs, k the
  /// fewest (at most max_calls) that take min_sample_ms at its last warm-up pace, as timeit's
  /// `number` does; a call of microseconds is then timed over milliseconds, where scheduler and
  /// interrupt noise averages out instead of being the sample. Each run replaces what the
  /// previous kept (freeing it inside the clock, as a loop does); `release` follows the sample.
  double min_sample_ms = 0;
  std::size_t max_calls = 1000;
};

/// Runs plan.warmup untimed then the planned timed repetitions of every candidate,
/// round-robin: in repetition r the candidates run in turn starting from candidate r mod n.
/// Each sample (one run, or k under min_sample_ms) is followed by `sync` inside the timed
/// region and by `release` outside it.
/// @returns one Timing per candidate, in the candidates' order, and the repetitions used.
/// @throws whatever a candidate throws; std::invalid_argument for an automatic plan without
///         warm-up.
RoundRobin time_round_robin(const std::vector<Candidate>& candidates, const RepPlan& plan,
                            const std::function<void()>& sync, Progress& progress,
                            const std::string& stage);

}  // namespace treetensor::bench
