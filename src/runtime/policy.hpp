#pragma once
// The execution policy behind run() (policy.cpp): mode → strategy, and stream(automatic)'s
// learner (DESIGN.md §8). Not installed.

#include "treetensor/runtime/leaf_call.hpp"
#include "treetensor/runtime/stream.hpp"

#include <cstdint>

namespace treetensor::runtime::detail {

/// One-time measurements of this machine (taken at the first automatic decision).
struct Calibration {
  double handoff_s = 0;   ///< caller → parked worker → caller round trip
  double dispatch_s = 0;  ///< one small ATen op on the calling thread
  double flop_rate = 0;   ///< float32 matmul flop/s on one thread
  double byte_rate = 0;   ///< bytes/s of a one-thread copy (read + write counted)
  double took_s = 0;      ///< time the calibration itself took
};
const Calibration& calibration();

/// The plan for one call: the decision plus, under automatic, what to report back.
struct Plan {
  Decision decision;
  std::uint64_t key = 0;  ///< learner key; 0 when the call is not timed
};

/// TREETENSOR_INLINE=1 (read once).
bool inline_mode();
/// Decides how to run `call` under `mode`. `commit` advances the learner's exploration
/// (false for explain()).
Plan plan(const LeafCall& call, const StreamMode& mode, bool commit);
/// Reports the wall time of a timed call; `fused_refused` when LeafCall::fused returned false.
void report(const Plan& plan, double seconds, bool fused_refused);

}  // namespace treetensor::runtime::detail
