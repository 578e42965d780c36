#pragma once
// The environment switch of the caching CPU allocator (cpu_allocator.cpp), read by the dispatch
// point at the first tree call. Not installed.

namespace treetensor::runtime::detail {

/// Installs the caching CPU allocator when TREETENSOR_CACHING_CPU_ALLOCATOR=1; returns
/// whether it did.
bool install_cpu_allocator_from_environment();

}  // namespace treetensor::runtime::detail
