// The CUDA half (DESIGN.md §18): compiled and linked in every build against a CUDA LibTorch,
// run where a GPU exists. Per-lane streams and their events (§7), asyncs workers' streams (§10),
// device moves and flat execution on CUDA buffers, optimizer steps on CUDA trees. Every test
// that needs a GPU skips with its reason where there is none; the first test runs everywhere
// and fails when a CUDA LibTorch's CUDA half did not make it into the process.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <gtest/gtest.h>

#include <iostream>
#include <mutex>
#include <set>
#include <string>

#include "treetensor/treetensor.hpp"

namespace tt = treetensor;
using tt::TreeTensor;

namespace {

int cuda_devices() {
  if (!c10::impl::hasDeviceGuardImpl(c10::kCUDA)) return 0;
  return c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount();
}

#define REQUIRE_GPU()                                                                          \
  do {                                                                                         \
    if (cuda_devices() == 0)                                                                   \
      GTEST_SKIP() << "needs a CUDA device: this machine has none (the CUDA code is compiled " \
                      "and linked; scripts/gpu-check.sh runs these tests on a GPU machine)";   \
  } while (0)

const at::Device kGpu(at::kCUDA, 0);

// A tree of n leaves "l00".."l<n-1>" of shape {r, c} on the GPU, seeded.
TreeTensor gpu_tree(int n, std::int64_t r, std::int64_t c, std::uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  TreeTensor t;
  for (int i = 0; i < n; ++i) {
    const std::string key = (i < 10 ? "l0" : "l") + std::to_string(i);
    t.insert(key, TreeTensor(at::randn({r, c}, gen).to(kGpu)));
  }
  return t;
}

// Makes a fresh pool stream current on the calling thread for the scope: results must then be
// right without the caller ever touching the default stream (DESIGN.md §7).
class OnPoolStream {
 public:
  OnPoolStream()
      : impl_(c10::kCUDA), previous_(impl_.exchangeStream(impl_.getStreamFromGlobalPool(kGpu))) {}
  ~OnPoolStream() { impl_.exchangeStream(previous_); }
  c10::Stream stream() const { return impl_.getStream(kGpu); }

 private:
  c10::impl::VirtualGuardImpl impl_;
  c10::Stream previous_;
};

void expect_bitwise(const TreeTensor& got, const TreeTensor& ref) {
  const auto g = tt::tree::flatten(got), r = tt::tree::flatten(ref);
  ASSERT_EQ(g.leaves.size(), r.leaves.size());
  for (std::size_t i = 0; i < g.leaves.size(); ++i) {
    const auto a = tt::rounding::compare_bitwise(g.leaves[i].cpu(), r.leaves[i].cpu());
    EXPECT_TRUE(a.holds()) << "leaf " << g.spec.paths()[i].describe() << ": " << a.describe();
  }
}

}  // namespace

TEST(CudaPlatform, CudaHalfCompiledAndLinked) {
#if TREETENSOR_WITH_CUDA
  // libtorch_cuda registers CUDA's device guard when it is loaded: the device-generic stream
  // backend of lanes and asyncs workers (DESIGN.md §7, §10) finds CUDA through it.
  EXPECT_TRUE(c10::impl::hasDeviceGuardImpl(c10::kCUDA))
      << "built against a CUDA LibTorch, but libtorch_cuda is not loaded in this process";
  const int n = cuda_devices();
  std::cout << "CUDA compiled: yes, GPU present: "
            << (n > 0 ? "yes (" + std::to_string(n) + " devices)" : std::string("no")) << "\n";
#else
  GTEST_SKIP() << "CUDA compiled: no (built against a CPU-only LibTorch)";
#endif
}

// stream(M) on CUDA leaves: each lane runs its leaves on its own stream, which waits for the
// caller's stream first; the caller's stream waits for every lane after; so a result read on
// the caller's stream is right with no synchronize, and equals the linear result (cuBLAS on
// another stream: to the matmul rounding bound).
TEST(CudaLanes, LaneStreamsGiveLinearValuesWithoutSynchronize) {
  REQUIRE_GPU();
  OnPoolStream caller;
  // Inputs produced on the caller's stream just before the call (a lane that did not wait for
  // it would read unfinished memory).
  const TreeTensor a = gpu_tree(16, 512, 512, 1) * 1.0, b = gpu_tree(16, 512, 512, 2) * 1.0;
  TreeTensor linear, lanes;
  {
    tt::runtime::StreamGuard g(1);
    linear = tt::matmul(a, b);
  }
  std::mutex mutex;
  std::set<c10::StreamId> streams;
  {
    tt::runtime::StreamGuard g(4);
    lanes = tt::apply(
        [&](const at::Tensor& x, const at::Tensor& y) {
          {
            std::lock_guard lock(mutex);
            streams.insert(c10::impl::VirtualGuardImpl(c10::kCUDA).getStream(kGpu).id());
          }
          return at::matmul(x, y);
        },
        a, b);
  }
  EXPECT_GT(streams.size(), 1u) << "every leaf ran on one stream: lanes took no leaf";
  const auto la = tt::tree::flatten(lanes), li = tt::tree::flatten(linear);
  const auto fa = tt::tree::flatten(a), fb = tt::tree::flatten(b);
  for (std::size_t i = 0; i < la.leaves.size(); ++i) {
    const auto agree = tt::rounding::compare_matmul(la.leaves[i].cpu(), li.leaves[i].cpu(),
                                                    fa.leaves[i].cpu(), fb.leaves[i].cpu());
    EXPECT_TRUE(agree.holds()) << la.spec.paths()[i].describe() << ": " << agree.describe();
  }
}

// runtime::synchronize() waits for the lane streams too (a host read after it needs no event).
TEST(CudaLanes, SynchronizeWaitsForLaneStreams) {
  REQUIRE_GPU();
  const TreeTensor a = gpu_tree(8, 256, 256, 3);
  TreeTensor r;
  {
    tt::runtime::StreamGuard g(2);
    r = a.sigmoid();
  }
  tt::runtime::synchronize();
  tt::runtime::StreamGuard g(1);
  expect_bitwise(r, a.sigmoid());
}

// An asyncs worker runs its jobs on its own CUDA stream, after the submitter's stream (a
// device-side wait), and the submitter's later tree calls wait for the job's writes.
TEST(CudaAsyncs, WorkerStreamOrderedWithTheSubmitter) {
  REQUIRE_GPU();
  OnPoolStream caller;
  at::Tensor x = at::randn({1024, 1024}).to(kGpu) * 3.0;  // made on the caller's stream
  at::Tensor y = at::zeros_like(x);
  tt::asyncs::Thread worker("cuda-worker");
  c10::StreamId job_stream = 0;
  auto done = worker.submit(
      [&] {
        job_stream = c10::impl::VirtualGuardImpl(c10::kCUDA).getStream(kGpu).id();
        y.copy_(at::matmul(x, x));
      },
      {x}, {y});
  const TreeTensor t{{"y", y}};
  const TreeTensor z = t + 1.0;  // a tree call: waits for the job that writes y
  done.get();
  EXPECT_NE(job_stream, caller.stream().id());
  const at::Tensor ref = at::matmul(x, x) + 1.0;
  const auto agree = tt::rounding::compare_matmul(z.at("y").leaf().cpu() - 1.0, (ref - 1.0).cpu(),
                                                  x.cpu(), x.cpu());
  EXPECT_TRUE(agree.holds()) << agree.describe();
}

// Device moves of a tree, and a consolidated tree on the GPU: to() keeps it consolidated, flat
// ops run one kernel per CUDA buffer and give the per-leaf loop's bits.
TEST(CudaTensors, DeviceMovesAndFlatExecutionOnCudaBuffers) {
  REQUIRE_GPU();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  TreeTensor cpu{{"a", at::randn({3, 5}, gen)},
                 {"b", {{"x", at::randn({7}, gen)}, {"y", at::randn({2, 2}, gen)}}}};
  const TreeTensor gpu = cpu.to(kGpu);
  EXPECT_EQ(tt::single(gpu.device()).type(), at::kCUDA);
  expect_bitwise(gpu.to(at::Device(at::kCPU)), cpu);

  const TreeTensor c = tt::consolidate(gpu);
  ASSERT_TRUE(tt::is_consolidated(c));
  EXPECT_EQ(tt::consolidated_groups(c).at(0).buffer.device().type(), at::kCUDA);
  const TreeTensor flat = c * 2.0 + c;
  EXPECT_TRUE(tt::is_consolidated(flat));
  expect_bitwise(flat, gpu * 2.0 + gpu);
  const TreeTensor back = c.to(at::Device(at::kCPU));
  EXPECT_TRUE(tt::is_consolidated(back));
  expect_bitwise(back, cpu);
}

// Adam on CUDA trees (the at:: ops: the single-pass kernels are CPU kernels) against the CPU
// step from the same state, to the step's derived rounding bound.
TEST(CudaOptim, AdamStepOnCudaTreesAgreesWithCpu) {
  REQUIRE_GPU();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  TreeTensor p{{"w", at::randn({64, 32}, gen)}, {"b", at::randn({32}, gen)}};
  const TreeTensor g{{"w", at::randn({64, 32}, gen)}, {"b", at::randn({32}, gen)}};
  TreeTensor pg = p.to(kGpu), m = tt::zeros_like(p), v = tt::zeros_like(p);
  TreeTensor mg = m.to(kGpu), vg = v.to(kGpu);
  const TreeTensor p0 = p.clone();
  const auto opts = tt::AdamOptions().lr(1e-2).weight_decay(1e-2);
  tt::adam_step(p, g, m, v, 1, opts);
  tt::adam_step_single_pass(pg, g.to(kGpu), mg, vg, 1, opts);
  for (const char* k : {"w", "b"}) {
    const auto bound = tt::rounding::adam_step_bound(
        {p0.at(k).leaf(), g.at(k).leaf(), at::zeros_like(p0.at(k).leaf()),
         at::zeros_like(p0.at(k).leaf()), 1e-2, 0.9, 0.999, 1e-8, 1e-2, 1});
    const auto agree = tt::rounding::compare_within(pg.at(k).leaf().cpu(), p.at(k).leaf(), bound);
    EXPECT_TRUE(agree.holds()) << k << ": " << agree.describe();
  }
}
