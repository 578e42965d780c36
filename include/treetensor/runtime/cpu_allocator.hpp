#pragma once
// An opt-in caching CPU allocator (DESIGN.md §6: page faults on fresh outputs, which two lanes
// take at once).
//
// Measured on the 2-core machine (bench/runtime_bench, faults counter): 200 leaves of
// 64×128 @ 128×256 kept alive take ~0.2 minor page faults per call when one thread runs them
// all, but ~650 per call on two lanes, and ~5000 at 128×256 @ 256×512: an output freed on one
// lane goes back to the glibc arena of the lane that allocated it, whose top gets trimmed and
// faulted in again, and two lanes faulting at once contend on the process's page tables.
// The caching allocator keeps freed blocks of 64 KiB and more, by page-rounded size, and hands
// them out again with their pages still mapped, so steady-state tree calls take no faults.
// Smaller blocks go to the allocator that was installed before.
//
// It is opt-in because it changes process-wide behaviour: it is LibTorch's CPU allocator for
// every tensor allocated after installation (c10::SetCPUAllocator), and the memory it caches is
// not returned to the system (up to a cap). Enable with use_caching_cpu_allocator() or the
// environment variable TREETENSOR_CACHING_CPU_ALLOCATOR=1 (read at the first tree call).

#include <cstddef>

namespace treetensor::runtime {

/// Counters of the caching allocator (all zero when it is not installed).
struct CpuCacheStats {
  std::size_t hits = 0;          ///< allocations served from the cache
  std::size_t misses = 0;        ///< cacheable allocations that had to go to the system
  std::size_t cached_bytes = 0;  ///< bytes now held in the cache (free blocks)
};

/// Installs the caching allocator as LibTorch's CPU allocator (first call only; later calls
/// just update the cap).
/// @param max_cached_bytes  most bytes of free blocks kept; blocks freed beyond it go back to
///                          the system. Default 1 GiB.
/// @throws std::runtime_error when another CPU allocator with a higher priority is installed.
/// Thread safety: thread-safe; tensors allocated before keep their own deleter and stay valid.
void use_caching_cpu_allocator(std::size_t max_cached_bytes = std::size_t{1} << 30);

/// True once use_caching_cpu_allocator() (or the environment variable) has installed it.
bool caching_cpu_allocator_installed();

/// Current counters. Thread safety: thread-safe.
CpuCacheStats caching_cpu_allocator_stats();

}  // namespace treetensor::runtime
