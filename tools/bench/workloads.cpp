#include "workloads.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
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

Verification::Verification(std::string subject, Comparator compare, std::string perturb,
                           std::string baseline)
    : subject_(std::move(subject)),
      perturb_(std::move(perturb)),
      baseline_(std::move(baseline)),
      compare_(std::move(compare)) {}

namespace {
// --perturb-row: the first result's largest element moves by 1e-3 of its value (by 1 in an
// integer result, e.g. a file's bytes).
void perturb_first(TensorMap& got) {
  if (got.empty()) return;
  at::Tensor& x = got.begin()->second;
  if (x.numel() == 0) return;
  x = x.clone();
  at::Tensor flat = x.view({-1});
  if (!at::isFloatingType(x.scalar_type())) {
    flat[0].add_(1);
    return;
  }
  const auto i = flat.abs().argmax().item<std::int64_t>();
  flat[i].mul_(1.001);
}
}  // namespace

void Verification::check(const std::string& strategy, const TensorMap& want, TensorMap got,
                         std::size_t expected_keys) {
  if (strategy == perturb_) perturb_first(got);
  std::string why;
  double worst = 0;
  bool bitwise = true;
  if (got.size() != expected_keys)
    why = fmt::format("{} results, expected {}", got.size(), expected_keys);
  for (auto it = got.begin(); why.empty() && it != got.end(); ++it) {
    const auto& [key, g] = *it;
    auto w = want.find(key);
    if (w == want.end()) {
      why = "unexpected result '" + key + "'";
      continue;
    }
    const rounding::Agreement a = compare_(key, g, w->second);
    if (!a.holds()) why = "'" + key + "': " + a.describe();
    worst = std::max(worst, a.worst_ratio);
    bitwise = bitwise && a.bitwise;
  }
  names_.push_back(strategy);
  failures_.push_back(why);
  worst_.push_back(worst);
  bitwise_.push_back(why.empty() && bitwise);
}

bool Verification::all_passed() const {
  return failed().empty();
}

std::vector<std::string> Verification::failed() const {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < names_.size(); ++i)
    if (!failures_[i].empty()) out.push_back(names_[i]);
  return out;
}

std::string Verification::note() const {
  std::string failed, exact, close;
  for (std::size_t i = 0; i < names_.size(); ++i) {
    if (!failures_[i].empty()) {
      failed += "; " + names_[i] + ": " + failures_[i];
    } else if (bitwise_[i]) {
      exact += (exact.empty() ? "" : ", ") + names_[i];
    } else {
      close += fmt::format("{}{} ({:.2g} of the bound)", close.empty() ? "" : ", ", names_[i],
                           worst_[i]);
    }
  }
  if (!failed.empty()) return subject_ + ": NOT VERIFIED" + failed;
  return fmt::format("{}: all {} strategies match {} before timing; bitwise equal: {}{}", subject_,
                     names_.size(), baseline_, exact.empty() ? "none" : exact,
                     close.empty() ? "" : "; within the rounding bound: " + close);
}

RepPlan rep_plan(const Config& cfg) {
  return RepPlan{cfg.warmup, cfg.reps, cfg.rep_budget_s, kAutoRepsMin, kAutoRepsMax};
}

}  // namespace treetensor::bench
