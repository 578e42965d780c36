// The distributed layer's cross-rank rules without ranks: what the signature compares, how a
// difference reads, how buckets split by device and which dtypes each backend reduces. Meta
// tensors stand in for CUDA ones where only the device type matters, so these run anywhere.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <limits>
#include <string>
#include <vector>

#include "distributed/agreement.hpp"
#include "distributed/buckets.hpp"

namespace dist = treetensor::distributed;
namespace internal = treetensor::distributed::detail;
using treetensor::tree::Path;

TEST(DistributedAgreement, SignaturesNameDeviceTypesAndTheDifferenceNamesThePath) {
  const std::vector<Path> paths{Path::parse("a"), Path::parse("x.w")};
  const std::vector<at::Tensor> cpu{at::ones({2}), at::ones({3})};
  const std::vector<at::Tensor> meta{at::ones({2}), at::empty({3}, at::device(at::kMeta))};
  const auto a = internal::signature(paths, cpu), b = internal::signature(paths, meta);
  EXPECT_NE(internal::fnv1a(a), internal::fnv1a(b));
  EXPECT_EQ(internal::first_difference(0, a, 1, b),
            "at path 'x.w': rank 0 has float32 [3] on cpu, rank 1 has float32 [3] on meta");
}

TEST(DistributedAgreement, BucketsNeverMixDevices) {
  // Same dtype, alternating devices, caps far above the sizes: one bucket per device.
  const std::vector<at::Tensor> leaves{at::ones({4}), at::empty({4}, at::device(at::kMeta)),
                                       at::ones({4}), at::empty({4}, at::device(at::kMeta))};
  const auto plan = internal::plan_buckets(leaves, 1 << 20, 1 << 20);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0], (internal::Bucket{{0, 4}, {2, 4}}));
  EXPECT_EQ(plan[1], (internal::Bucket{{1, 4}, {3, 4}}));
}

TEST(DistributedAgreement, EachBackendReducesItsOwnDtypes) {
  EXPECT_TRUE(internal::reducible(at::kBFloat16, dist::ReduceOp::sum, c10::kCUDA));
  EXPECT_FALSE(internal::reducible(at::kBFloat16, dist::ReduceOp::sum, c10::kCPU));
  EXPECT_FALSE(internal::reducible(at::kShort, dist::ReduceOp::sum, c10::kCUDA));
  EXPECT_TRUE(internal::reducible(at::kBool, dist::ReduceOp::product, c10::kCUDA));
  EXPECT_FALSE(internal::reducible(at::kComplexFloat, dist::ReduceOp::max, c10::kCUDA));
  const std::string nccl = internal::irreducible_text(at::kShort, dist::ReduceOp::sum, c10::kCUDA);
  EXPECT_NE(nccl.find("NCCL cannot reduce int16 by sum"), std::string::npos) << nccl;
  EXPECT_NE(nccl.find("bfloat16"), std::string::npos) << nccl;
  const std::string gloo =
      internal::irreducible_text(at::kBFloat16, dist::ReduceOp::sum, c10::kCPU);
  EXPECT_NE(gloo.find("Gloo cannot reduce bfloat16"), std::string::npos) << gloo;
}

TEST(DistributedAgreement, SmallCpuReductionsGoByExchange) {
  const auto op = dist::ReduceOp::sum;
  const int64_t limit = internal::kExchangeMaxBytes / 4;  // float32 elements, 2 ranks
  EXPECT_TRUE(internal::exchanges(at::ones({limit}), op, 2));
  EXPECT_FALSE(internal::exchanges(at::ones({limit + 1}), op, 2));
  EXPECT_FALSE(internal::exchanges(at::ones({limit}), op, 3));  // 2 peers' copies: twice the bytes
  EXPECT_FALSE(internal::exchanges(at::ones({4}), op, 1));
  EXPECT_FALSE(internal::exchanges(at::ones({0}), op, 2));
  EXPECT_FALSE(internal::exchanges(at::empty({4}, at::device(at::kMeta)), op, 2));  // not the CPU
  EXPECT_FALSE(internal::exchanges(at::ones({4}, at::kBool), op, 2));  // Gloo's any, as uint8
  EXPECT_TRUE(internal::exchanges(at::ones({4}), dist::ReduceOp::avg, 2));
  EXPECT_TRUE(internal::exchanges(at::ones({4}, at::kLong), dist::ReduceOp::max, 2));
  EXPECT_FALSE(internal::exchanges(at::ones({4}), dist::ReduceOp::max, 2));  // NaN: Gloo's own
  EXPECT_FALSE(internal::exchanges(at::ones({4}, at::kLong), dist::ReduceOp::product, 2));
}

// Values whose float32 sum depends on the order of the additions.
std::vector<at::Tensor> spread_parts(int world) {
  std::vector<at::Tensor> parts;
  for (int k = 0; k < world; ++k) {
    const auto i = at::arange(64, at::kDouble);
    const auto exponent = at::remainder(i * 7 + k * 5, 13) - 6;
    parts.push_back((at::pow(10.0, exponent) * (1 + 0.37 * k) * at::cos(i + k)).to(at::kFloat));
  }
  return parts;
}

TEST(DistributedAgreement, AnExchangeReducesInRankOrderOnEveryRank) {
  const int world = 4;
  const auto values = spread_parts(world);
  at::Tensor want = values[0].clone();
  for (int k = 1; k < world; ++k) want = want + values[k];
  ASSERT_FALSE(at::equal(want, ((values[0] + values[2]) + values[1]) + values[3]))
      << "the values must depend on the order of the additions, or this test cannot fail";
  for (int own = 0; own < world; ++own) {
    std::vector<at::Tensor> parts;  // own buffer at `own`, received copies elsewhere
    for (const auto& v : values) parts.push_back(v.clone());
    internal::reduce_in_rank_order(parts, own, dist::ReduceOp::sum);
    EXPECT_TRUE(at::equal(parts[own], want)) << "rank " << own;
  }
  // NaNs of opposite signs on ranks 0 and 1: a1 + a0 would keep the other one.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<at::Tensor> nans{at::full({64}, -nan), at::full({64}, nan), at::ones({64})};
  at::Tensor bits;
  for (int own = 0; own < 3; ++own) {
    std::vector<at::Tensor> parts;
    for (const auto& v : nans) parts.push_back(v.clone());
    internal::reduce_in_rank_order(parts, own, dist::ReduceOp::sum);
    const auto mine = parts[own].view(at::kInt);
    if (own == 0) bits = mine;
    EXPECT_TRUE(at::equal(mine, bits)) << "NaN bits on rank " << own;
  }
  std::vector<at::Tensor> ints{at::tensor({3, -1}), at::tensor({2, 7}), at::tensor({5, 0})};
  internal::reduce_in_rank_order(ints, 2, dist::ReduceOp::min);
  EXPECT_TRUE(at::equal(ints[2], at::tensor({2, -1})));
  ints = {at::tensor({3, -1}), at::tensor({2, 7}), at::tensor({5, 0})};
  internal::reduce_in_rank_order(ints, 1, dist::ReduceOp::max);
  EXPECT_TRUE(at::equal(ints[1], at::tensor({5, 7})));
}
