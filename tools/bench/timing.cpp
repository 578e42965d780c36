#include "timing.hpp"

#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <stdexcept>

namespace treetensor::bench {

Progress::Progress(bool enabled) : enabled_(enabled), tty_(isatty(STDERR_FILENO) != 0) {}

Progress::~Progress() {
  clear();
}

void Progress::update(const std::string& stage, const std::string& detail) {
  if (!enabled_) return;
  if (tty_) {
    std::fprintf(stderr, "\r%s: %s\033[K", stage.c_str(), detail.c_str());
    std::fflush(stderr);
  } else if (stage != last_stage_) {
    std::fprintf(stderr, "%s\n", stage.c_str());
  }
  last_stage_ = stage;
}

void Progress::clear() {
  if (enabled_ && tty_ && !last_stage_.empty()) std::fprintf(stderr, "\r\033[K");
  last_stage_.clear();
}

std::function<void()> device_synchronizer(c10::Device device) {
  if (!device.is_cuda()) return [] {};
  using SyncFn = int (*)();
  if (auto fn = reinterpret_cast<SyncFn>(dlsym(RTLD_DEFAULT, "cudaDeviceSynchronize")))
    return [fn] { fn(); };
  return [device] {
    c10::impl::VirtualGuardImpl impl(device.type());
    impl.getStream(device).synchronize();
  };
}

namespace {

using Clock = std::chrono::steady_clock;

// glibc defers merging the small blocks a release frees until the next large request, and
// bills it there: after a row freed 200 small tensors, the next row's first 3 KiB allocation
// took 6-7 us instead of 0.8 here (as much as a whole flat tree call). One aligned request
// (as LibTorch's CPU allocator makes) after each release settles that work outside the clock.
void settle_allocator() {
  void* p = nullptr;
  if (posix_memalign(&p, 64, std::size_t{64} << 10) == 0) std::free(p);
}

// One round: one sample of every candidate (calls[i] runs of candidate i), starting from
// `first`. Returns each candidate's time per run (ms).
std::vector<double> one_round(const std::vector<Candidate>& candidates,
                              const std::vector<std::size_t>& calls, std::size_t first,
                              const std::function<void()>& sync, Progress& progress,
                              const std::string& stage, const std::string& what) {
  const std::size_t n = candidates.size();
  std::vector<double> ms(n);
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t i = (first + k) % n;
    const Candidate& c = candidates[i];
    progress.update(stage, what + " " + c.name);
    const auto t0 = Clock::now();
    for (std::size_t call = 0; call < calls[i]; ++call) c.run();
    sync();
    const auto t1 = Clock::now();
    if (c.release) c.release();
    settle_allocator();
    ms[i] = std::chrono::duration<double, std::milli>(t1 - t0).count() / double(calls[i]);
  }
  return ms;
}

// Runs per sample: enough for plan.min_sample_ms at the pace `ms` of one run (RepPlan).
std::vector<std::size_t> calls_per_sample(const RepPlan& plan, const std::vector<double>& ms) {
  std::vector<std::size_t> calls(ms.size(), 1);
  if (plan.min_sample_ms <= 0) return calls;
  for (std::size_t i = 0; i < ms.size(); ++i) {
    const double k = std::ceil(plan.min_sample_ms / std::max(ms[i], 1e-6));
    calls[i] = std::clamp<std::size_t>(static_cast<std::size_t>(std::min(k, 1e9)), 1,
                                       std::max<std::size_t>(plan.max_calls, 1));
  }
  return calls;
}

Timing summarize(const std::vector<double>& samples) {
  Timing t;
  double sum = 0, sq = 0;
  for (double s : samples) sum += s;
  t.mean_ms = sum / double(samples.size());
  for (double s : samples) sq += (s - t.mean_ms) * (s - t.mean_ms);
  t.std_ms = samples.size() > 1 ? std::sqrt(sq / double(samples.size() - 1)) : 0.0;
  return t;
}

}  // namespace

RoundRobin time_round_robin(const std::vector<Candidate>& candidates, const RepPlan& plan,
                            const std::function<void()>& sync, Progress& progress,
                            const std::string& stage) {
  if (plan.fixed == 0 && plan.warmup == 0)
    throw std::invalid_argument("an automatic number of repetitions needs a warm-up");
  double round_ms = 0;
  std::size_t warmup = plan.warmup, min_reps = plan.min_reps;
  RoundRobin out;
  out.calls.assign(candidates.size(), 1);
  std::vector<double> pace(candidates.size(), 0.0);
  for (std::size_t r = 0; r < warmup; ++r) {
    pace = one_round(candidates, out.calls, r, sync, progress, stage,
                     "warm-up " + std::to_string(r + 1) + "/" + std::to_string(warmup));
    round_ms = std::accumulate(pace.begin(), pace.end(), 0.0);
    if (plan.fixed == 0 && plan.slow_min_reps && round_ms > plan.budget_s * 1e3) {
      warmup = std::min<std::size_t>(warmup, 2);
      min_reps = std::min(min_reps, plan.slow_min_reps);
    }
  }
  if (warmup > 0) {
    out.calls = calls_per_sample(plan, pace);
    round_ms = 0;
    for (std::size_t i = 0; i < pace.size(); ++i) round_ms += pace[i] * double(out.calls[i]);
  }
  out.reps = plan.fixed;
  if (out.reps == 0) {
    const double fit = std::ceil(plan.budget_s * 1e3 / std::max(round_ms, 1e-3));
    out.reps = std::clamp(static_cast<std::size_t>(std::min(fit, 1e9)), min_reps, plan.max_reps);
  }
  std::vector<std::vector<double>> samples(candidates.size());
  for (std::size_t r = 0; r < out.reps; ++r) {
    const auto ms = one_round(candidates, out.calls, warmup + r, sync, progress, stage,
                              "rep " + std::to_string(r + 1) + "/" + std::to_string(out.reps));
    for (std::size_t i = 0; i < ms.size(); ++i) samples[i].push_back(ms[i]);
  }
  for (const auto& s : samples) out.timings.push_back(summarize(s));
  return out;
}

}  // namespace treetensor::bench
