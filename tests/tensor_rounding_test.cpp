// The shared "same up to rounding" verifier (treetensor/tensor/rounding.hpp, DESIGN.md §5):
// it accepts matmuls that OpenBLAS computed with 1 and with 2 threads above its threading
// threshold (another summation order on some CPUs, e.g. the Zen kernels), and rejects one
// element moved by 1e-3 of its value.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <dlfcn.h>

#include <cmath>
#include <limits>
#include <stdexcept>

#include "treetensor/tensor/rounding.hpp"

namespace rd = treetensor::rounding;

namespace {

// OpenBLAS's process-wide thread count, set through its C API (looked up at run time, as the
// runtime does, so the test also builds against another BLAS).
bool set_blas_threads(int n) {
  using SetFn = void (*)(int);
  auto set = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (!set) return false;
  set(n);
  return true;
}
int blas_threads() {
  using GetFn = int (*)();
  auto get = reinterpret_cast<GetFn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return get ? get() : 0;
}

struct Sizes {
  int64_t m, k, n;
};

class MatmulThreads : public ::testing::TestWithParam<Sizes> {};

}  // namespace

TEST(Rounding, UnitRoundoffAndGamma) {
  EXPECT_EQ(rd::unit_roundoff(at::kFloat), std::ldexp(1.0, -24));
  EXPECT_EQ(rd::unit_roundoff(at::kDouble), std::ldexp(1.0, -53));
  EXPECT_EQ(rd::unit_roundoff(at::kHalf), std::ldexp(1.0, -11));
  EXPECT_EQ(rd::unit_roundoff(at::kBFloat16), std::ldexp(1.0, -8));
  EXPECT_THROW(rd::unit_roundoff(at::kInt), std::invalid_argument);
  const double u = std::ldexp(1.0, -24);
  EXPECT_DOUBLE_EQ(rd::gamma(256, at::kFloat), 256 * u / (1 - 256 * u));
  EXPECT_EQ(rd::gamma(0, at::kFloat), 0.0);
  EXPECT_THROW(rd::gamma(300, at::kBFloat16), std::invalid_argument) << "n·u >= 1: no bound";
  EXPECT_EQ(rd::accumulate_type(at::kBFloat16), at::kFloat);
  EXPECT_EQ(rd::accumulate_type(at::kDouble), at::kDouble);
}

TEST(Rounding, BitwiseMeansEveryBit) {
  const at::Tensor x = at::tensor({1.0f, 0.0f, NAN});
  EXPECT_TRUE(rd::compare_bitwise(x, x.clone()).bitwise);
  EXPECT_TRUE(rd::compare_bitwise(x, x.clone()).holds());
  EXPECT_EQ(rd::compare_bitwise(x, x.clone()).describe(), "bitwise equal");
  const at::Tensor negative_zero = at::tensor({1.0f, -0.0f, NAN});
  EXPECT_FALSE(rd::compare_bitwise(negative_zero, x).holds()) << "-0 and +0 differ in bits";
  const at::Tensor off = at::tensor({1.0f + 1e-7f, 0.0f, NAN});
  const auto a = rd::compare_bitwise(off, x);
  EXPECT_FALSE(a.holds());
  EXPECT_EQ(a.worst_index, 0);
  EXPECT_EQ(a.describe(), "inf times the rounding bound at element 0");
  EXPECT_EQ(rd::compare_bitwise(x, x.to(at::kDouble)).describe(),
            "got Float [3], expected Double [3]");
  EXPECT_FALSE(rd::compare_bitwise(x, x.reshape({3, 1})).holds());
}

TEST(Rounding, WithinAnElementwiseBound) {
  const at::Tensor ref = at::tensor({1.0, 2.0, 3.0});
  const at::Tensor got = at::tensor({1.0, 2.5, 3.0});
  const auto within = rd::compare_within(got, ref, at::tensor({0.0, 1.0, 0.0}));
  EXPECT_TRUE(within.holds());
  EXPECT_DOUBLE_EQ(within.worst_ratio, 0.5);
  EXPECT_EQ(within.describe(), "0.5 of the rounding bound");
  const auto outside = rd::compare_within(got, ref, at::tensor(0.25));
  EXPECT_FALSE(outside.holds());
  EXPECT_EQ(outside.describe(), "2 times the rounding bound at element 1");
  // NaN on one side only is never within a bound.
  EXPECT_FALSE(rd::compare_within(at::tensor({NAN}), at::tensor({1.0}), at::tensor(1e9)).holds());
}

// The issue's sizes: both above OpenBLAS's threading threshold (m·n·k >= 2^19).
TEST_P(MatmulThreads, OneAndTwoBlasThreadsAgreeAndOneChangedElementIsCaught) {
  const auto [m, k, n] = GetParam();
  const int before = blas_threads();
  at::manual_seed(3);
  const at::Tensor a = at::randn({m, k}), b = at::randn({k, n});
  if (!set_blas_threads(1)) GTEST_SKIP() << "BLAS is not OpenBLAS: no thread count to set";
  const at::Tensor one = at::matmul(a, b);
  set_blas_threads(2);
  const at::Tensor two = at::matmul(a, b);
  set_blas_threads(before);

  const auto agreement = rd::compare_matmul(two, one, a, b);
  EXPECT_TRUE(agreement.holds()) << agreement.describe();
  RecordProperty("worst_ratio", std::to_string(agreement.worst_ratio));
  std::cout << m << "x" << k << " @ " << k << "x" << n
            << ", 2 vs 1 BLAS threads: " << agreement.describe() << "\n";

  // The largest-magnitude element moved by 1e-3 of its value lies outside the bound.
  at::Tensor changed = two.clone();
  const int64_t i = changed.view({-1}).abs().argmax().item<int64_t>();
  changed.view({-1})[i].mul_(1.001);
  const auto caught = rd::compare_matmul(changed, one, a, b);
  EXPECT_FALSE(caught.holds()) << caught.describe();
  EXPECT_EQ(caught.worst_index, i);
}

INSTANTIATE_TEST_SUITE_P(IssueSizes, MatmulThreads,
                         ::testing::Values(Sizes{64, 128, 256}, Sizes{128, 256, 512}),
                         [](const auto& info) {
                           return std::to_string(info.param.m) + "x" +
                                  std::to_string(info.param.k) + "x" + std::to_string(info.param.n);
                         });

TEST(Rounding, MatmulBoundCoversNarrowDtypesAndVectors) {
  at::manual_seed(4);
  const at::Tensor a = at::randn({16, 64}), b = at::randn({64, 8});
  // (float16 has no CPU matmul in LibTorch 1.13; its bound takes the same path as bfloat16's.)
  for (auto dtype : {at::kBFloat16, at::kDouble}) {
    const at::Tensor ad = a.to(dtype), bd = b.to(dtype);
    // float64 reference rounded to the dtype vs the dtype's own kernel.
    const at::Tensor ref = at::matmul(ad.to(at::kDouble), bd.to(at::kDouble)).to(dtype);
    const auto agreement = rd::compare_matmul(at::matmul(ad, bd), ref, ad, bd);
    EXPECT_TRUE(agreement.holds()) << c10::toString(dtype) << ": " << agreement.describe();
  }
  const at::Tensor v = at::randn({100}), w = at::randn({100});
  EXPECT_TRUE(rd::compare_matmul(at::dot(v, w), at::dot(v.flip(0), w.flip(0)), v, w).holds());
  EXPECT_THROW(rd::compare_matmul(at::zeros({2}), at::zeros({2}), a, b), std::invalid_argument);
  EXPECT_THROW(rd::matmul_bound(at::ones({2, 2}, at::kInt), at::ones({2, 2}, at::kInt), at::kInt),
               std::invalid_argument);
}
