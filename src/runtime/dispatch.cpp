// runtime::run(): the single dispatch point, executing a LeafCall linearly, on lanes or fused,
// after the hooks of the layers above (DESIGN.md, layers); synchronize() and explain().
#include "treetensor/runtime/dispatch.hpp"

#include "runtime/cpu_allocator_env.hpp"
#include "runtime/device_streams.hpp"
#include "runtime/fork.hpp"
#include "runtime/kernel_threads.hpp"
#include "runtime/lanes.hpp"
#include "runtime/policy.hpp"
#include "runtime/thread_mode.hpp"
#include "treetensor/runtime/errors.hpp"
#include "treetensor/runtime/stream.hpp"

#include <ATen/ThreadLocalState.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <vector>

namespace treetensor::runtime {
namespace {

// Leaf exceptions of one call, by leaf index. Each slot is written only by the thread that ran
// that leaf; they are read after the join.
class LeafErrors {
 public:
  explicit LeafErrors(std::size_t leaves) : slots_(leaves) {}
  void set(std::size_t leaf, std::exception_ptr e) {
    slots_[leaf] = std::move(e);
    any_.store(true, std::memory_order_relaxed);  // read after the join, which orders it
  }
  /// Rethrows the first failing leaf's exception with context; the others are listed.
  void rethrow_if_any(const LeafCall& call) const;

 private:
  std::vector<std::exception_ptr> slots_;
  std::atomic<bool> any_{false};
};

// A c10 warning a leaf raises on a lane goes to the caller's warning handler (Python's makes
// it a Python warning), one at a time: c10's handler is per thread, and the caller's need not
// be thread-safe.
class ForwardWarnings final : public c10::WarningHandler {
 public:
  ForwardWarnings() : to_(c10::WarningUtils::get_warning_handler()) {}
  void process(const c10::Warning& warning) override {
    const std::lock_guard lock(m_);
    to_->process(warning);
  }

 private:
  c10::WarningHandler* const to_;
  std::mutex m_;
};

void LeafErrors::rethrow_if_any(const LeafCall& call) const {
  if (!any_.load(std::memory_order_relaxed)) return;
  std::vector<LeafFailure> failures;
  for (std::size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i]) failures.push_back({call.label(i), slots_[i]});
  rethrow_leaf_failures(call.op, failures);
}

void run_linear(const LeafCall& call) {
  std::vector<LeafFailure> failures;
  for (std::size_t i = 0; i < call.leaves; ++i) {
    try {
      call.run(i);
    } catch (...) {
      failures.push_back({call.label(i), std::current_exception()});
    }
  }
  if (!failures.empty()) rethrow_leaf_failures(call.op, failures);
}

// Piece boundaries: contiguous leaf ranges of about equal estimated cost, `per_lane` pieces
// per lane. Contiguous ranges keep leaf order within a lane (outputs allocated in order, one
// atomic claim per piece instead of per leaf); several pieces per lane let a lane that starts
// late (a parked worker wakes in tens of µs) or runs slow take fewer, so the estimate need
// not be exact.
std::vector<std::size_t> piece_bounds(const LeafCall& call, std::size_t lanes) {
  constexpr std::size_t per_lane = 4;
  const std::size_t pieces = std::min(call.leaves, lanes * per_lane);
  std::vector<std::size_t> bounds{0};
  bounds.reserve(pieces + 1);
  if (!call.cost) {
    for (std::size_t p = 1; p <= pieces; ++p) bounds.push_back(call.leaves * p / pieces);
    return bounds;
  }
  // Weight: flops and bytes at rough single-thread rates, plus a fixed per-leaf dispatch.
  std::vector<double> prefix(call.leaves + 1, 0.0);
  for (std::size_t i = 0; i < call.leaves; ++i) {
    const LeafCost c = call.cost(i);
    prefix[i + 1] = prefix[i] + c.flops / 1e10 + c.bytes / 5e9 + 1e-6;
  }
  for (std::size_t p = 1; p < pieces; ++p) {
    const double target = prefix.back() * static_cast<double>(p) / static_cast<double>(pieces);
    std::size_t cut = static_cast<std::size_t>(
        std::lower_bound(prefix.begin(), prefix.end(), target) - prefix.begin());
    cut = std::clamp(cut, bounds.back() + 1, call.leaves - (pieces - p));
    bounds.push_back(cut);
  }
  bounds.push_back(call.leaves);
  return bounds;
}

class LeafBatch final : public detail::Batch {
 public:
  LeafBatch(const LeafCall& call, std::size_t lanes, std::vector<std::size_t> bounds,
            detail::CallerStreams* streams)
      : Batch(bounds.size() - 1, lanes - 1),
        call_(call),
        bounds_(std::move(bounds)),
        errors_(call.leaves),
        mode_(current_stream_mode()),
        streams_(streams) {}

  // Caller side: claims pieces until none is left, on the caller's own stream.
  void run_own_share() {
    const c10::WarningUtils::WarningHandlerGuard forward(&warnings_);
    std::size_t piece = 0, ran = 0;
    while (claim(piece)) {
      run_piece(piece);
      ++ran;
    }
    finish(ran);
  }

  // Worker side. Nothing of the caller's (its stack-held stream state, the LeafCall) is
  // touched before a piece is claimed: a worker admitted late may find every piece done and
  // the caller already returned; a claimed piece keeps the caller waiting.
  void participate(std::size_t lane) noexcept override {
    std::size_t piece = 0;
    if (!claim(piece)) return;
    std::size_t ran = 0;
    bool set_up = false;
    try {
      at::ThreadLocalStateGuard tls(tls_);
      const c10::WarningUtils::WarningHandlerGuard forward(&warnings_);
      detail::ThreadModeScope mode(mode_);
      std::optional<detail::LaneStreams> streams;
      if (streams_) streams.emplace(*streams_, lane);
      set_up = true;
      do {
        run_piece(piece);
        ++ran;
      } while (claim(piece));
      if (streams) streams->finish();
    } catch (...) {
      // Leaf exceptions are caught per leaf, so this is lane set-up or stream hand-back
      // failing. A claimed piece that could not run fails its leaves with that error (every
      // leaf still accounted for exactly once); the failure is reported after the join.
      if (!set_up) {
        fail_piece(piece, std::current_exception());
        ran = 1;
      }
      if (!lane_failed_.exchange(true)) lane_error_ = std::current_exception();
    }
    finish(ran);
  }

  void rethrow_if_failed() const {
    errors_.rethrow_if_any(call_);
    if (lane_error_)
      rethrow_with_context(lane_error_, std::string(call_.op) + ": lane stream set-up");
  }

 private:
  void fail_piece(std::size_t piece, const std::exception_ptr& e) {
    for (std::size_t i = bounds_[piece]; i < bounds_[piece + 1]; ++i) errors_.set(i, e);
  }

  void run_piece(std::size_t piece) {
    for (std::size_t i = bounds_[piece]; i < bounds_[piece + 1]; ++i) {
      try {
        call_.run(i);
      } catch (...) {
        errors_.set(i, std::current_exception());
      }
    }
  }

  const LeafCall& call_;
  const std::vector<std::size_t> bounds_;
  LeafErrors errors_;
  const at::ThreadLocalState tls_;  // captured on the caller: grad/inference mode, autocast, ...
  ForwardWarnings warnings_;        // to the caller's handler, captured on the caller
  const StreamMode mode_;
  detail::CallerStreams* const streams_;
  std::atomic<bool> lane_failed_{false};
  std::exception_ptr lane_error_;  // written by the first failing lane, before its finish()
};

void run_lanes(const LeafCall& call, std::size_t lanes) {
  detail::ensure_workers(lanes - 1);
  std::optional<detail::CallerStreams> streams;
  if (auto backend = detail::backend_for(call.device))
    streams.emplace(std::move(backend), call.device);
  detail::OneBlasThread one_blas_thread;
  auto batch = std::make_shared<LeafBatch>(call, lanes, piece_bounds(call, lanes),
                                           streams ? &*streams : nullptr);
  detail::submit(batch);
  {
    detail::OneIntraOpThread one_intra_op_thread;
    batch->run_own_share();
  }
  batch->wait_done();
  detail::retire(batch.get());
  if (streams) streams->join();
  batch->rethrow_if_failed();
}

// Runs the fused form; returns false (nothing ran) when it declines.
bool run_fused(const LeafCall& call) {
  try {
    return call.fused();
  } catch (...) {
    rethrow_with_context(std::current_exception(), std::string(call.op) + " (fused)");
  }
}

void execute(const LeafCall& call, const detail::Plan& plan) {
  switch (plan.decision.strategy) {
    case Strategy::linear:
      return run_linear(call);
    case Strategy::lanes:
      return run_lanes(call, plan.decision.lanes);
    case Strategy::fused:
      if (!run_fused(call)) run_linear(call);
      return;
  }
}

// The execution strategy, past every hook.
void run_past_hooks(const LeafCall& call) {
  const StreamMode mode = current_stream_mode();
  if (mode == StreamMode{} && !detail::inline_mode()) return run_linear(call);  // the default
  const detail::Plan plan = detail::plan(call, mode, /*commit=*/true);
  if (plan.key == 0) return execute(call, plan);
  // Timed for the automatic learner.
  const auto t0 = std::chrono::steady_clock::now();
  bool refused = false;
  if (plan.decision.strategy == Strategy::fused) {
    refused = !run_fused(call);
    if (refused) run_linear(call);
  } else {
    execute(call, plan);
  }
  detail::report(plan, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                 refused);
}

// ---- hooks of the layers above -----------------------------------------------------------------
// Call hooks are read on every tree call: a fixed array and a count published with release, so
// the hot path is one acquire load (a plain load on x86) when no layer has registered.
constexpr std::size_t kMaxHooks = 8;
std::mutex hooks_mutex;  // serialises registration; run() never takes it, synchronize() does
const int hooks_mutex_held_over_fork = (detail::hold_over_fork(hooks_mutex), 0);
std::array<std::atomic<CallHook>, kMaxHooks> call_hooks{};
std::atomic<std::size_t> call_hook_count{0};
std::vector<SynchronizeHook> synchronize_hooks;  // guarded by hooks_mutex

// Runs `call` from hook `first` on; a hook that takes the call over continues from the next one.
void run_from(const LeafCall& call, std::size_t first) {
  const std::size_t hooks = call_hook_count.load(std::memory_order_acquire);
  for (std::size_t h = first; h < hooks; ++h) {
    auto proceed = [h](const LeafCall& c) { run_from(c, h + 1); };
    if (call_hooks[h].load(std::memory_order_relaxed)(call, proceed)) return;
  }
  run_past_hooks(call);
}

}  // namespace

void run(const LeafCall& call) {
  if (call.leaves == 0) return;
  static const bool env_allocator = detail::install_cpu_allocator_from_environment();
  static const bool env_spin = detail::read_spin_from_environment();
  (void)env_allocator;
  (void)env_spin;
  run_from(call, 0);
}

void add_call_hook(CallHook hook) {
  std::lock_guard lock(hooks_mutex);
  const std::size_t n = call_hook_count.load(std::memory_order_relaxed);
  if (n == kMaxHooks)
    throw std::length_error("treetensor runtime: add_call_hook: all " + std::to_string(kMaxHooks) +
                            " hook slots are taken");
  call_hooks[n].store(hook, std::memory_order_relaxed);
  call_hook_count.store(n + 1, std::memory_order_release);
}

void add_synchronize_hook(SynchronizeHook hook) {
  std::lock_guard lock(hooks_mutex);
  if (synchronize_hooks.size() == kMaxHooks)
    throw std::length_error("treetensor runtime: add_synchronize_hook: all " +
                            std::to_string(kMaxHooks) + " hook slots are taken");
  synchronize_hooks.push_back(hook);
}

void synchronize() {
  std::vector<SynchronizeHook> hooks;
  {
    std::lock_guard lock(hooks_mutex);
    hooks = synchronize_hooks;
  }
  std::exception_ptr first;
  for (SynchronizeHook hook : hooks) {
    try {
      hook();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  synchronize_lane_streams();
  if (first) std::rethrow_exception(first);
}

Decision explain(const LeafCall& call) {
  if (call.leaves == 0) return Decision{Strategy::linear, 1, "no leaves"};
  return detail::plan(call, current_stream_mode(), /*commit=*/false).decision;
}

}  // namespace treetensor::runtime
