#pragma once
// The NCCL backend of a group (DESIGN.md §14): c10d's ProcessGroupNCCL, the group's second
// backend, for its CUDA buckets. nccl.cpp is the only file that includes ProcessGroupNCCL.hpp.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

namespace treetensor::distributed::detail {

/// Whether this build has c10d's NCCL backend (TREETENSOR_WITH_NCCL at configure time: a CUDA
/// LibTorch and nccl.h). Without it CUDA leaves are refused.
inline constexpr bool kNcclBuilt = TREETENSOR_WITH_NCCL;

/// A ProcessGroupNCCL over `store` behind the prefix "nccl" (its keys never meet Gloo's), each
/// collective bounded by `timeout` through c10d's NCCL watchdog. Communicators are made at the
/// first collective on a device, by every rank in the same round (the agreement decides it).
/// Call only where kNcclBuilt.
c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                            int world, std::chrono::milliseconds timeout);

}  // namespace treetensor::distributed::detail
