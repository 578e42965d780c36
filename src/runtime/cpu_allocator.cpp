#include "treetensor/runtime/cpu_allocator.hpp"

#include "runtime/cpu_allocator_env.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace treetensor::runtime {
namespace {

constexpr std::size_t kMinCached = std::size_t{64} << 10;  // below this, faults are rare
constexpr std::size_t kPage = 4096;
constexpr std::size_t kHeader = 64;  // keeps the user pointer 64-byte aligned, like c10

// Cached blocks carry their page-rounded size in a header in front of the user pointer.
class CachingCpuAllocator final : public c10::Allocator {
 public:
  explicit CachingCpuAllocator(c10::Allocator* fallback) : fallback_(fallback) {}

  c10::DataPtr allocate(std::size_t n) override {
    if (n < kMinCached) return fallback_->allocate(n);
    const std::size_t size = (n + kPage - 1) / kPage * kPage;
    void* user = take(size);
    if (user == nullptr) {
      void* raw = std::aligned_alloc(kPage, size + kPage);  // header in the first page
      if (raw == nullptr) throw std::bad_alloc();
      user = static_cast<char*>(raw) + kPage;
      *header(user) = size;
    }
    return {user, user, &release, c10::Device(c10::kCPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count > 0) std::memcpy(dest, src, count);
  }

  void set_cap(std::size_t bytes) { cap_.store(bytes); }
  CpuCacheStats stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }

 private:
  static std::size_t* header(void* user) {
    return reinterpret_cast<std::size_t*>(static_cast<char*>(user) - kHeader);
  }
  static void release(void* user);

  void* take(std::size_t size) const {
    std::lock_guard lock(mutex_);
    auto it = free_.find(size);
    if (it == free_.end() || it->second.empty()) {
      ++stats_.misses;
      return nullptr;
    }
    void* user = it->second.back();
    it->second.pop_back();
    stats_.cached_bytes -= size;
    ++stats_.hits;
    return user;
  }

  void give_back(void* user) const {
    const std::size_t size = *header(user);
    {
      std::lock_guard lock(mutex_);
      if (stats_.cached_bytes + size <= cap_.load()) {
        free_[size].push_back(user);
        stats_.cached_bytes += size;
        return;
      }
    }
    std::free(static_cast<char*>(user) - kPage);
  }

  c10::Allocator* const fallback_;
  std::atomic<std::size_t> cap_{std::size_t{1} << 30};
  mutable std::mutex mutex_;
  mutable std::unordered_map<std::size_t, std::vector<void*>> free_;
  mutable CpuCacheStats stats_;
};

std::atomic<CachingCpuAllocator*> installed{nullptr};

void CachingCpuAllocator::release(void* user) {
  installed.load()->give_back(user);
}

}  // namespace

void use_caching_cpu_allocator(std::size_t max_cached_bytes) {
  static std::mutex install_mutex;
  std::lock_guard lock(install_mutex);
  if (auto* a = installed.load()) return a->set_cap(max_cached_bytes);
  // Deliberately leaked: tensors freed during static destruction still call into it.
  auto* a = new CachingCpuAllocator(c10::GetCPUAllocator());
  a->set_cap(max_cached_bytes);
  installed.store(a);
  c10::SetCPUAllocator(a, /*priority=*/1);
  if (c10::GetCPUAllocator() != a)
    throw std::runtime_error(
        "treetensor: use_caching_cpu_allocator: a CPU allocator with a higher priority is "
        "installed; the caching allocator was not installed");
}

namespace detail {
bool install_cpu_allocator_from_environment() {
  const char* v = std::getenv("TREETENSOR_CACHING_CPU_ALLOCATOR");
  if (v == nullptr || v[0] == '\0' || v[0] == '0') return false;
  use_caching_cpu_allocator();
  return true;
}
}  // namespace detail

bool caching_cpu_allocator_installed() {
  auto* a = installed.load();
  return a != nullptr && c10::GetCPUAllocator() == a;
}

CpuCacheStats caching_cpu_allocator_stats() {
  auto* a = installed.load();
  return a ? a->stats() : CpuCacheStats{};
}

}  // namespace treetensor::runtime
