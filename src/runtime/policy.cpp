// stream(automatic): a calibrated cost model for tiny calls plus a per-call-shape learner.
//
// Why a learner and not a formula: on this class of machine the winner between linear, lanes
// and fused depends on effects no cheap model predicts well — OpenBLAS's behaviour under
// concurrent callers, page faults on fresh outputs that two lanes take at once, and the
// intra-op threads of a fused kernel (measured: README, "When tree-level parallelism pays"). Values
// never depend on the strategy (DESIGN.md §5), so the runtime may simply measure: for each call
// shape (op, device, dtype, leaf-count and cost buckets) it times linear first, tries the other
// strategies a few times, then keeps the fastest, re-checking a rival now and then. A non-linear
// strategy must beat linear by a margin, and calls whose work is a few hand-offs' worth never leave
// the caller, which keeps automatic within a few percent of linear on every shape.
#include "runtime/policy.hpp"

#include "runtime/fork.hpp"
#include "runtime/lanes.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <mutex>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>

namespace treetensor::runtime::detail {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

// A batch of one piece that only a worker may run: the caller just waits, so the time is a
// pure hand-off round trip.
struct PingBatch final : Batch {
  PingBatch() : Batch(1, 1) {}
  void participate(std::size_t) noexcept override {
    std::size_t piece = 0;
    finish(claim(piece) ? 1 : 0);
  }
};

// Hand-off round trips to a parked worker; the median of a few. A worker may be unable to
// answer (all busy — calibration can start inside a leaf — or none after a fork): the ping is
// then taken back after a deadline and the design's figure (DESIGN.md §8) is used, so
// calibration never waits on work nobody will run.
double measure_handoff() {
  constexpr double fallback_s = 30e-6;
  ensure_workers(1);
  std::array<double, 7> trips{};
  for (double& trip : trips) {
    // Let the worker park first: a tree call after a pause pays the full wake-up.
    const auto pause_until = Clock::now() + std::chrono::microseconds(spin_microseconds() + 50);
    while (Clock::now() < pause_until) {
    }
    const auto t0 = Clock::now();
    auto ping = std::make_shared<PingBatch>();
    submit(ping);
    const auto deadline = t0 + std::chrono::milliseconds(20);
    while (!ping->exhausted() && Clock::now() < deadline) std::this_thread::yield();
    std::size_t piece = 0;
    const bool unanswered = ping->claim(piece);
    if (unanswered) ping->finish(1);
    ping->wait_done();
    retire(ping.get());
    if (unanswered) return fallback_s;
    trip = seconds_since(t0);
  }
  std::sort(trips.begin(), trips.end());
  return trips[trips.size() / 2];
}

template <class F>
double best_time(int reps, F&& f) {
  double best = std::numeric_limits<double>::infinity();
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    f();
    best = std::min(best, seconds_since(t0));
  }
  return best;
}

Calibration calibrate() {
  const auto t0 = Clock::now();
  Calibration c;
  c.handoff_s = measure_handoff();
  at::NoGradGuard no_grad;
  const at::Tensor one = at::ones({1});
  constexpr int ops = 100;
  c.dispatch_s = best_time(3,
                           [&] {
                             for (int i = 0; i < ops; ++i) (void)at::add(one, one);
                           }) /
                 ops;
  const at::Tensor a = at::ones({64, 128}), b = at::ones({128, 128});
  c.flop_rate = 2.0 * 64 * 128 * 128 / best_time(4, [&] { (void)at::mm(a, b); });
  const at::Tensor src = at::ones({1 << 18});
  at::Tensor dst = at::empty_like(src);
  c.byte_rate = 2.0 * static_cast<double>(src.nbytes()) / best_time(4, [&] { dst.copy_(src); });
  c.took_s = seconds_since(t0);
  return c;
}

// ---- the learner -------------------------------------------------------------------------

constexpr int kStrategies = 3;  // indexed by Strategy
constexpr int kSamples = 2;     // timed tries of each strategy before trusting it
constexpr std::uint64_t kRecheckEvery = 64;
constexpr double kMargin = 0.97;       // a rival must beat linear by 3% to be chosen
constexpr double kTinyHandoffs = 3.0;  // calls cheaper than this many hand-offs stay linear

struct Arm {
  int samples = 0;
  double seconds = 0;  // moving average of the wall time per call
  std::uint64_t last_call = 0;
};

struct Entry {
  std::array<Arm, kStrategies> arms{};
  bool fused_refused = false;
  std::uint64_t calls = 0;
};

std::mutex learner_mutex;
// Every tree call takes it, on any thread: a child forked meanwhile must not inherit it locked.
const int learner_mutex_held_over_fork = (hold_over_fork(learner_mutex), 0);
std::unordered_map<std::uint64_t, Entry>& entries() {
  static auto* map = new std::unordered_map<std::uint64_t, Entry>;
  return *map;
}

std::string micros(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f us", s * 1e6);
  return buf;
}

// Estimated seconds of all leaf work, or a negative number when the call gives no costs.
double estimate_seconds(const LeafCall& call, const Calibration& c) {
  if (!call.cost) return -1;
  double s = 0;
  for (std::size_t i = 0; i < call.leaves; ++i) {
    const LeafCost lc = call.cost(i);
    s += lc.flops / c.flop_rate + lc.bytes / c.byte_rate + c.dispatch_s;
  }
  return s;
}

std::uint64_t key_of(const LeafCall& call, double estimate) {
  const std::uint64_t leaves_bucket = std::bit_width(call.leaves);
  const std::uint64_t cost_bucket =
      estimate < 0 ? 0 : static_cast<std::uint64_t>(std::max(0.0, 2 * std::log2(estimate * 1e8)));
  std::uint64_t h = std::hash<std::string_view>{}(call.op);
  h ^= (static_cast<std::uint64_t>(call.device.type()) << 1) * 0x9e3779b97f4a7c15ULL;
  h ^= (static_cast<std::uint64_t>(call.dtype) + (leaves_bucket << 8) + (cost_bucket << 16)) *
       0xc2b2ae3d27d4eb4fULL;
  return h | 1;  // 0 means "not timed"
}

// Reasons are text for explain() and TREETENSOR_LOG_POLICY only; run() skips building them.
thread_local bool want_reason = true;

template <class Reason>
Decision decision(Strategy s, std::size_t lanes, Reason&& reason) {
  return Decision{s, s == Strategy::lanes ? lanes : 1,
                  want_reason ? std::string(reason()) : std::string()};
}

std::string arm_summary(const Entry& e, std::size_t lanes) {
  std::string out;
  for (int s = 0; s < kStrategies; ++s) {
    const Arm& a = e.arms[static_cast<std::size_t>(s)];
    if (a.samples == 0) continue;
    if (!out.empty()) out += ", ";
    out += static_cast<Strategy>(s) == Strategy::lanes ? "lanes(" + std::to_string(lanes) + ")"
                                                       : to_string(static_cast<Strategy>(s));
    out += " " + micros(a.seconds);
  }
  return out;
}

Plan learn(const LeafCall& call, std::size_t lanes, double estimate, bool commit) {
  const Calibration& c = calibration();
  Plan p;
  p.key = key_of(call, estimate);
  // Shapes measured tiny stay linear for good; remembered per thread to skip the lock.
  thread_local std::unordered_set<std::uint64_t> settled_linear;
  if (!want_reason && settled_linear.count(p.key) != 0)
    return Plan{Decision{Strategy::linear, 1, {}}, 0};
  std::lock_guard lock(learner_mutex);
  Entry& e = entries()[p.key];
  const std::uint64_t now = commit ? ++e.calls : e.calls + 1;
  std::array<bool, kStrategies> allowed{true, lanes > 1, call.fused && !e.fused_refused};
  const Arm& linear = e.arms[0];
  auto pick = [&](Strategy s, auto why) {
    p.decision = decision(s, lanes, why);
    return p;
  };
  if (linear.samples == 0) return pick(Strategy::linear, [] { return "measuring linear first"; });
  if (linear.seconds < kTinyHandoffs * c.handoff_s) {
    if (commit) settled_linear.insert(p.key);
    p.key = 0;  // settled for good: no need to keep timing
    return pick(Strategy::linear, [&] {
      return "measured linear " + micros(linear.seconds) + " < 3x hand-off " + micros(c.handoff_s);
    });
  }
  for (int s = 0; s < kStrategies; ++s) {
    const auto& arm = e.arms[static_cast<std::size_t>(s)];
    if (allowed[static_cast<std::size_t>(s)] && arm.samples < kSamples)
      return pick(static_cast<Strategy>(s), [&] {
        return "exploring (sample " + std::to_string(arm.samples + 1) + "/" +
               std::to_string(kSamples) + ")";
      });
  }
  int best = 0;
  for (int s = 1; s < kStrategies; ++s) {
    const auto& arm = e.arms[static_cast<std::size_t>(s)];
    if (allowed[static_cast<std::size_t>(s)] && arm.seconds < kMargin * linear.seconds &&
        arm.seconds < e.arms[static_cast<std::size_t>(best)].seconds)
      best = s;
  }
  if (now % kRecheckEvery == 0) {
    // Re-check the rival sampled longest ago, so a shape whose winner changes is noticed.
    int stale = -1;
    for (int s = 0; s < kStrategies; ++s) {
      const auto& arm = e.arms[static_cast<std::size_t>(s)];
      if (s != best && allowed[static_cast<std::size_t>(s)] &&
          (stale < 0 || arm.last_call < e.arms[static_cast<std::size_t>(stale)].last_call))
        stale = s;
    }
    if (stale >= 0) return pick(static_cast<Strategy>(stale), [] { return "periodic re-check"; });
  }
  return pick(static_cast<Strategy>(best), [&] { return "measured: " + arm_summary(e, lanes); });
}

bool log_enabled() {
  static const bool enabled = env_flag("TREETENSOR_LOG_POLICY");
  return enabled;
}

void log_decision(const LeafCall& call, const Decision& d) {
  if (!log_enabled()) return;
  std::fprintf(stderr, "treetensor policy: %.*s leaves=%zu -> %s(%zu): %s\n",
               static_cast<int>(call.op.size()), call.op.data(), call.leaves, to_string(d.strategy),
               d.lanes, d.reason.c_str());
}

Plan plan_automatic(const LeafCall& call, const StreamMode& mode, bool commit) {
  const std::size_t lanes = std::min(mode.lanes, call.leaves);
  if (call.leaves < 2)
    return Plan{decision(Strategy::linear, 1, [] { return "fewer than 2 leaves"; }), 0};
  const Calibration& c = calibration();
  const double estimate = estimate_seconds(call, c);
  if (estimate >= 0 && estimate < kTinyHandoffs * c.handoff_s)
    return Plan{decision(Strategy::linear, 1,
                         [&] {
                           return "tiny: estimated " + micros(estimate) + " < 3x hand-off " +
                                  micros(c.handoff_s);
                         }),
                0};
  return learn(call, lanes, estimate, commit);
}

// The calibration runs once per process, for milliseconds, under this lock. Not a function-local
// static: a child forked while another thread calibrated would wait for ever on the static's
// guard (and hold_over_fork cannot take a lock held while waiting for workers to start). A child
// gets a fresh lock instead (leaked, as the parent's copy), and calibrates itself unless the
// parent had finished. Constant-initialised: usable before this file's dynamic initialisation.
std::mutex first_calibration_mutex;
std::atomic<std::mutex*> calibration_mutex{&first_calibration_mutex};
const int calibration_mutex_fresh_in_children = [] {
  if (const int err =
          pthread_atfork(nullptr, nullptr, [] { calibration_mutex.store(new std::mutex); }))
    throw std::system_error(err, std::generic_category(), "treetensor: pthread_atfork");
  return 0;
}();
std::atomic<const Calibration*> calibrated{nullptr};

}  // namespace

const Calibration& calibration() {
  if (const Calibration* c = calibrated.load(std::memory_order_acquire)) return *c;
  const std::lock_guard lock(*calibration_mutex.load());
  if (const Calibration* c = calibrated.load(std::memory_order_acquire)) return *c;
  const Calibration* c = new Calibration(calibrate());  // for the process's lifetime
  calibrated.store(c, std::memory_order_release);
  return *c;
}

bool inline_mode() {
  static const bool enabled = env_flag("TREETENSOR_INLINE");
  return enabled;
}

Plan plan(const LeafCall& call, const StreamMode& mode, bool commit) {
  want_reason = !commit || log_enabled();
  if (inline_mode())
    return Plan{decision(Strategy::linear, 1, [] { return "TREETENSOR_INLINE=1"; }), 0};
  Plan p;
  switch (mode.kind) {
    case StreamMode::Kind::lanes:
      if (mode.lanes == 1 || call.leaves < 2)
        p.decision = decision(Strategy::linear, 1, [&] { return mode.to_string(); });
      else
        p.decision = decision(Strategy::lanes, std::min(mode.lanes, call.leaves),
                              [&] { return mode.to_string(); });
      return p;
    case StreamMode::Kind::fused:
      p.decision = call.fused ? decision(Strategy::fused, 1, [] { return "stream(fused)"; })
                              : decision(Strategy::linear, 1,
                                         [] { return "stream(fused): op has no fused form"; });
      return p;
    case StreamMode::Kind::automatic:
      p = plan_automatic(call, mode, commit);
      if (commit) log_decision(call, p.decision);
      return p;
  }
  return p;
}

void report(const Plan& p, double seconds, bool fused_refused) {
  if (p.key == 0) return;
  std::lock_guard lock(learner_mutex);
  Entry& e = entries()[p.key];
  if (fused_refused) {
    e.fused_refused = true;
    return;
  }
  Arm& arm = e.arms[static_cast<std::size_t>(p.decision.strategy)];
  // The exploration samples keep their best (a first call pays one-off page faults); later
  // samples are averaged with weight 1/3 so that a one-off stall fades out.
  if (arm.samples == 0)
    arm.seconds = seconds;
  else if (arm.samples < kSamples)
    arm.seconds = std::min(arm.seconds, seconds);
  else
    arm.seconds += (seconds - arm.seconds) / 3;
  ++arm.samples;
  arm.last_call = e.calls;
}

}  // namespace treetensor::runtime::detail
