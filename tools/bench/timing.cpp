#include "timing.hpp"

#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <dlfcn.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>

namespace treetensor::bench {

Progress::Progress(bool enabled) : enabled_(enabled), tty_(isatty(STDERR_FILENO) != 0) {}

Progress::~Progress() { clear(); }

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

std::vector<Timing> time_round_robin(const std::vector<Candidate>& candidates, std::size_t warmup,
                                     std::size_t reps, const std::function<void()>& sync,
                                     Progress& progress, const std::string& stage) {
  using clock = std::chrono::steady_clock;
  const std::size_t n = candidates.size();
  std::vector<std::vector<double>> samples(n);
  for (std::size_t r = 0; r < warmup + reps; ++r) {
    const bool timed = r >= warmup;
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t i = (r + k) % n;
      const Candidate& c = candidates[i];
      progress.update(stage, (timed ? "rep " + std::to_string(r - warmup + 1) + "/" +
                                          std::to_string(reps)
                                    : "warm-up " + std::to_string(r + 1) + "/" +
                                          std::to_string(warmup)) +
                                 " " + c.name);
      const auto t0 = clock::now();
      c.run();
      sync();
      const auto t1 = clock::now();
      if (c.release) c.release();
      if (timed) samples[i].push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
  }
  std::vector<Timing> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    double sum = 0, sq = 0;
    for (double s : samples[i]) sum += s;
    out[i].mean_ms = sum / double(reps);
    for (double s : samples[i]) sq += (s - out[i].mean_ms) * (s - out[i].mean_ms);
    out[i].std_ms = reps > 1 ? std::sqrt(sq / double(reps - 1)) : 0.0;
  }
  return out;
}

}  // namespace treetensor::bench
