// The distributed layer across processes: each case starts its ranks (distributed_worker,
// worker.cpp) with the built-in launcher and a deadline, so a hang fails instead of eating CI.
#include <gtest/gtest.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include "treetensor/distributed/launch.hpp"

namespace dist = treetensor::distributed;

namespace {

#if defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

dist::LaunchResult run(const std::string& scenario, int nprocs, const std::string& store = "tcp",
                       std::map<std::string, std::string> env = {}, int timeout_s = 120) {
  dist::LaunchOptions o;
  o.nprocs = nprocs;
  o.timeout = std::chrono::seconds(timeout_s);
  o.env = std::move(env);
  if (kSanitized) {
    // The ranks run c10d's Gloo worker threads inside libtorch_cpu, which is not instrumented:
    // TSan cannot see its atomic reference counts, so a free or a condition-variable destroy
    // called from there would be reported against our earlier use. Only the ranks ignore
    // interceptor calls from uninstrumented code; races between instrumented accesses (ours)
    // are still reported.
    const char* t = std::getenv("TSAN_OPTIONS");
    o.env["TSAN_OPTIONS"] = std::string(t ? t : "") + " ignore_noninstrumented_modules=1";
  }
  return dist::launch(TREETENSOR_DIST_WORKER, {scenario, store}, o);
}

// CUDA devices here, through c10's device-generic API: no CUDA headers, so this builds with
// any LibTorch (a CPU-only one registers no CUDA implementation).
int cuda_devices() {
  if (!c10::impl::hasDeviceGuardImpl(c10::kCUDA)) return 0;
  return c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount();
}

// Why a CUDA case cannot run here (empty when it can): fewer than `gpus` GPUs (NCCL puts one
// rank on each), or this build has no NCCL.
std::string cuda_missing(int gpus) {
  if (const int n = cuda_devices(); n < gpus)
    return "needs " + std::to_string(gpus) + " CUDA device(s), this machine has " +
           std::to_string(n);
  if (!TREETENSOR_WITH_NCCL) return "this build has no NCCL (TREETENSOR_WITH_NCCL is off)";
  return {};
}

std::string file_store(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() /
           ("treetensor-test-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove(p);
  return "file:" + p.string();
}

}  // namespace

TEST(Distributed, EveryCollectiveTwoRanks) {
  const auto r = run("values", 2);
  EXPECT_TRUE(r.ok()) << r.describe();
}

TEST(Distributed, EveryCollectiveThreeRanks) {
  const auto r = run("values", 3);
  EXPECT_TRUE(r.ok()) << r.describe();
}

TEST(Distributed, EveryCollectiveInDebugMode) {  // per-bucket cross-rank checks on
  const auto r = run("values", 2, "tcp", {{"TREETENSOR_DIST_DEBUG", "1"}});
  EXPECT_TRUE(r.ok()) << r.describe();
}

// Refused arguments on one rank (both kinds of collective and send/recv), Gloo's missing
// dtypes, leaves that need grad, share memory or have a pending asyncs writer.
TEST(Distributed, RefusalsAndDtypes) {
  const auto r = run("refusals", 2);
  EXPECT_TRUE(r.ok()) << r.describe();
}

TEST(Distributed, EveryCollectiveWithFileStore) {
  const auto r = run("values", 2, file_store("values"));
  EXPECT_TRUE(r.ok()) << r.describe();
}

// OneFlow's shape: 7 asyncs threads x 2 ranks x 200 iterations (also under TSan), each result
// checked.
TEST(Distributed, SevenAsyncsThreadsTwoRanks) {
  const auto r = run("stress", 2, "tcp", {{"TREETENSOR_DIST_ITERATIONS", "200"}});
  EXPECT_TRUE(r.ok()) << r.describe();
}

TEST(Distributed, SevenAsyncsThreadsIssueOrderDiffersBetweenRanks) {
  const auto r = run("stress-reverse", 2, "tcp", {{"TREETENSOR_DIST_ITERATIONS", "200"}});
  EXPECT_TRUE(r.ok()) << r.describe();
}

TEST(Distributed, MismatchedStructureDtypeShapeOpAreErrorsOnEveryRank) {
  const auto r = run("mismatch", 2);
  EXPECT_TRUE(r.ok()) << r.describe();
}

TEST(Distributed, RequestOneRankNeverMakesIsAnErrorOnEveryRank) {
  const auto r = run("missing", 2, "tcp", {}, 60);
  EXPECT_TRUE(r.ok()) << r.describe();
}

TEST(Distributed, DeadRankIsAnErrorOnTheSurvivorWithinTheTimeout) {
  const auto r = run("dead", 2, "tcp", {}, 60);
  EXPECT_TRUE(r.ok()) << r.describe();
}

TEST(Distributed, StalledRankIsAnErrorWithinTheTimeout) {
  const auto r = run("stall", 2, "tcp", {}, 60);
  EXPECT_TRUE(r.ok()) << r.describe();
}

TEST(Distributed, SendRecvAfterATimeoutAreCollectiveErrorsInOneLine) {
  const auto r = run("p2p-timeout", 2, "tcp", {}, 60);
  EXPECT_TRUE(r.ok()) << r.describe();
}

// Three processes for a world of two: two claim rank 1.
TEST(Distributed, ADuplicateRankFailsAtOnceNamingTheRank) {
  const auto r = run("duplicate-rank", 3, "tcp", {}, 60);
  EXPECT_TRUE(r.ok()) << r.describe();
}

// CUDA leaves over NCCL: values of every collective, trees mixing CPU and CUDA leaves,
// consolidated CUDA trees, a caller on a non-default stream, the _async forms through asyncs.
TEST(DistributedCuda, EveryCollectiveOneRank) {
  if (const auto why = cuda_missing(1); !why.empty()) GTEST_SKIP() << why;
  const auto r = run("cuda", 1);
  EXPECT_TRUE(r.ok()) << r.describe();
}

TEST(DistributedCuda, EveryCollectiveTwoRanks) {
  if (const auto why = cuda_missing(2); !why.empty()) GTEST_SKIP() << why;
  const auto r = run("cuda", 2);
  EXPECT_TRUE(r.ok()) << r.describe();
}

// Only rank 0 uses the GPU: a cuda-vs-cpu leaf is a mismatch naming the path on both ranks,
// and send of a CUDA leaf is refused with the receiver told why.
TEST(DistributedCuda, DeviceTypeMismatchAndCudaSendTwoRanksOneGpu) {
  if (const auto why = cuda_missing(1); !why.empty()) GTEST_SKIP() << why;
  const auto r = run("cuda-mismatch", 2);
  EXPECT_TRUE(r.ok()) << r.describe();
}

TEST(DistributedCuda, WithoutNcclACudaLeafIsRefused) {
  if (cuda_devices() < 1) GTEST_SKIP() << "needs a CUDA device, this machine has none";
  if (TREETENSOR_WITH_NCCL) GTEST_SKIP() << "this build has NCCL: the cases above cover CUDA";
  const auto r = run("cuda-without-nccl", 1);
  EXPECT_TRUE(r.ok()) << r.describe();
}

// The launcher itself: a hang is killed at the deadline and reported.
TEST(Launcher, KillsRanksAtTheDeadline) {
  dist::LaunchOptions o;
  o.nprocs = 2;
  o.timeout = std::chrono::milliseconds(300);
  const auto start = std::chrono::steady_clock::now();
  const auto r = dist::launch("/bin/sleep", {"30"}, o);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  ASSERT_EQ(r.ranks.size(), 2u);
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE(r.ranks[0].timed_out && r.ranks[1].timed_out) << r.describe();
  EXPECT_NE(r.describe().find("killed at the deadline"), std::string::npos);
}

TEST(Launcher, SetsTorchrunVariables) {
  dist::LaunchOptions o;
  o.nprocs = 3;
  o.timeout = std::chrono::seconds(10);
  // Rank r exits with RANK + 10 * WORLD_SIZE when LOCAL_RANK equals RANK and MASTER_* are set.
  const auto r = dist::launch(
      "/bin/sh",
      {"-c",
       "[ \"$LOCAL_RANK\" = \"$RANK\" ] && [ -n \"$MASTER_ADDR\" ] && [ -n \"$MASTER_PORT\" ] && "
       "exit $((RANK + 10 * WORLD_SIZE))"},
      o);
  ASSERT_EQ(r.ranks.size(), 3u);
  for (int k = 0; k < 3; ++k) EXPECT_EQ(r.ranks[k].exit_code, k + 30) << r.describe();
}
