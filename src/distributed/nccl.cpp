#include "distributed/nccl.hpp"

#include "treetensor/tree/internal_error.hpp"

#if TREETENSOR_WITH_NCCL
#ifndef USE_C10D_NCCL
#error "TREETENSOR_WITH_NCCL needs c10d's NCCL backend (define USE_C10D_NCCL)"
#endif
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace treetensor::distributed::detail {

c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                            int world, std::chrono::milliseconds timeout) {
#if TREETENSOR_WITH_NCCL
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(
      c10::make_intrusive<c10d::PrefixStore>("nccl", store), rank, world, options);
#else
  (void)store, (void)rank, (void)world, (void)timeout;
  TREETENSOR_INTERNAL_ASSERT(false, "a CUDA leaf passed the refusals of a build without NCCL");
  return {};
#endif
}

}  // namespace treetensor::distributed::detail
