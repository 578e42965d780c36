// The seed experiment in a few lines of the TreeTensor API: a tree of N independent matmuls,
// run linearly, over M lanes (treetensor's stream(M)), under the automatic policy and fused
// (one bmm), against the hand-written std::map loop. Every strategy gives the same values.
//
//   seed_stream [N=200] [S=32] [M=2]     leaf i: S×2S @ 2S×4S, float32, CPU
#include <ATen/ATen.h>

#include <chrono>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <map>
#include <string>

#include "treetensor/treetensor.hpp"

namespace tt = treetensor;

namespace {

template <class F>
double best_ms(F&& f, int reps = 5) {
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 200;
  const int64_t s = argc > 2 ? std::atoll(argv[2]) : 32;
  const std::size_t m = argc > 3 ? std::strtoul(argv[3], nullptr, 10) : 2;

  // Shapes as a tree; randn fills every leaf (reproducibly, whatever the strategy).
  tt::ShapeTree lhs, rhs;
  for (int64_t i = 0; i < n; ++i) {
    lhs.insert("a" + std::to_string(i), tt::Shape{s, 2 * s});
    rhs.insert("a" + std::to_string(i), tt::Shape{2 * s, 4 * s});
  }
  at::manual_seed(0);
  const tt::TreeTensor a = tt::randn(lhs), b = tt::randn(rhs);

  // The native baseline: a std::map loop keeping every result.
  const auto ma = tt::to_state_dict(a), mb = tt::to_state_dict(b);
  std::map<std::string, at::Tensor> native;
  const double native_ms = best_ms([&] {
    native.clear();
    for (const auto& [k, x] : ma) native.emplace(k, at::matmul(x, mb.at(k)));
  });
  std::cout << "seed: " << n << " leaves of " << s << "x" << 2 * s << " @ " << 2 * s << "x" << 4 * s
            << "\n"
            << std::setw(18) << "native" << std::setw(10) << std::fixed << std::setprecision(3)
            << native_ms << " ms\n";

  const tt::TreeTensor want = tt::from_state_dict(native);
  // Same values up to rounding: a lane's BLAS runs one thread, so the summation order may differ.
  auto agrees = [&](const tt::TreeTensor& got) {
    for (const auto& path : got.paths()) {
      const auto& x = a.at(path).leaf();
      if (!tt::rounding::compare_matmul(got.at(path).leaf(), want.at(path).leaf(), x,
                                        b.at(path).leaf())
               .holds())
        return false;
    }
    return true;
  };
  auto row = [&](const std::string& name, tt::runtime::StreamMode mode) {
    tt::runtime::StreamGuard guard(mode);
    tt::TreeTensor got;
    const double ms = best_ms([&] { got = tt::matmul(a, b); });
    std::cout << std::setw(18) << name << std::setw(10) << ms << " ms  speed-up "
              << std::setprecision(2) << native_ms / ms << std::setprecision(3)
              << (agrees(got) ? "  (same values)" : "  (VALUES DIFFER)") << "\n";
  };
  row("linear", tt::runtime::StreamMode::of(1));
  row("stream(" + std::to_string(m) + ")", tt::runtime::StreamMode::of(m));
  row("automatic", tt::runtime::StreamMode::of(tt::runtime::automatic));
  row("fused (bmm)", tt::runtime::StreamMode::of(tt::runtime::fused));

  // Tree-level reduction and printing of a small tree.
  const tt::TreeTensor small = tt::randn({{"a", {2, 3}}, {"b", {{"x", {3}}}}});
  std::cout << small << "\nmean over every element: " << tt::mean(small).item<double>() << "\n";
  return 0;
}
