// The distributed layer's cross-rank rules without ranks: what the signature compares, how a
// difference reads, how buckets split by device and which dtypes each backend reduces. Meta
// tensors stand in for CUDA ones where only the device type matters, so these run anywhere.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

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
