#include "workloads.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <stdexcept>

namespace treetensor::bench {

void check_device(const Config& cfg) {
  if (cfg.device.is_cuda() && !at::hasCUDA())
    throw std::invalid_argument(
        "--device " + cfg.device.str() +
        ": this LibTorch build has no CUDA (at::hasCUDA() is false); use a CUDA build of "
        "LibTorch or run on the CPU");
  if (!cfg.device.is_cuda() && !cfg.device.is_cpu())
    throw std::invalid_argument("--device " + cfg.device.str() +
                                ": only cpu and cuda are supported");
}

Verification::Verification(std::string subject, c10::ScalarType dtype)
    : subject_(std::move(subject)), dtype_(dtype) {}

void Verification::check(const std::string& strategy, const TensorMap& want, const TensorMap& got,
                         std::size_t expected_keys) {
  const auto [rtol, atol] = tolerances(dtype_);
  std::string why;
  bool bitwise = true;
  if (got.size() != expected_keys)
    why = fmt::format("{} results, expected {}", got.size(), expected_keys);
  for (auto it = got.begin(); why.empty() && it != got.end(); ++it) {
    const auto& [key, g] = *it;
    auto w = want.find(key);
    if (w == want.end()) {
      why = "unexpected result '" + key + "'";
    } else if (!g.sizes().equals(w->second.sizes()) || g.scalar_type() != w->second.scalar_type()) {
      why = fmt::format("'{}' is {} {}, native {} {}", key, c10::toString(g.scalar_type()),
                        c10::str(g.sizes()), c10::toString(w->second.scalar_type()),
                        c10::str(w->second.sizes()));
    } else if (!at::allclose(g, w->second, rtol, atol)) {
      why = fmt::format("'{}' differs: max |diff| {:.3g}", key,
                        (g - w->second).abs().max().item<double>());
    } else {
      bitwise = bitwise && at::equal(g, w->second);
    }
  }
  names_.push_back(strategy);
  failures_.push_back(why);
  bitwise_.push_back(why.empty() && bitwise);
}

bool Verification::all_passed() const {
  for (const auto& f : failures_)
    if (!f.empty()) return false;
  return true;
}

std::string Verification::note() const {
  const auto [rtol, atol] = tolerances(dtype_);
  std::string failed, exact, close;
  for (std::size_t i = 0; i < names_.size(); ++i) {
    if (!failures_[i].empty()) failed += "; " + names_[i] + ": " + failures_[i];
    std::string& list = bitwise_[i] ? exact : close;
    list += (list.empty() ? "" : ", ") + names_[i];
  }
  if (!failed.empty()) return subject_ + ": VERIFICATION FAILED" + failed;
  return fmt::format(
      "{}: all {} strategies match native before timing (allclose rtol={:g} "
      "atol={:g}); bitwise equal: {}{}",
      subject_, names_.size(), rtol, atol, exact.empty() ? "none" : exact,
      close.empty() ? "" : "; within tolerance only: " + close);
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
