#include "workloads.hpp"

#include <ATen/Context.h>

#include <stdexcept>

namespace treetensor::bench {

void check_device(const Config& cfg) {
  if (cfg.device.is_cuda() && !at::hasCUDA())
    throw std::invalid_argument(
        "--device " + cfg.device.str() +
        ": this LibTorch build has no CUDA (at::hasCUDA() is false); use a CUDA build of "
        "LibTorch or run on the CPU");
  if (!cfg.device.is_cuda() && !cfg.device.is_cpu())
    throw std::invalid_argument("--device " + cfg.device.str() + ": only cpu and cuda are supported");
}

RepPlan rep_plan(const Config& cfg) {
  return RepPlan{cfg.warmup, cfg.reps, cfg.rep_budget_s, kAutoRepsMin, kAutoRepsMax};
}

std::pair<double, double> tolerances(c10::ScalarType dtype) {
  // 16-bit types round every output to 8 (bfloat16) or 11 (float16) significant bits, and
  // batched kernels may accumulate in another order.
  if (dtype == c10::kHalf || dtype == c10::kBFloat16) return {2e-2, 1e-1};
  return {1e-4, 1e-5};
}

}  // namespace treetensor::bench
