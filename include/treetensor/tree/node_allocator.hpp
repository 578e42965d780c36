#pragma once
// NodeAllocator: the allocator of a tree node's children array (Tree<T>::Children). Freed
// arrays are kept in a per-thread cache of power-of-two size classes and handed out again, so
// a call that builds a tree and drops one of the same shape (map, zip, unflatten: every tree
// call's result) reuses the same memory instead of returning it to the C library, which gives
// it back to the OS past its trim threshold: on machines that pay ~6 µs per page fault that
// costs more than building the tree (DESIGN.md §1, Memory). Standard library only.
//
// Bounds: a thread keeps at most kCacheBytes of freed arrays, at most kClassBytes of one size
// class (so arrays of one size cannot crowd out the others), and only arrays up to
// kLargestCached bytes; beyond that, frees go straight to operator delete. The cache is the
// thread's own (no locks; an array freed on another thread than it was made on joins that thread's
// cache) and is released when the thread exits. Under AddressSanitizer nothing is cached, so a use
// after free of a node is still reported.

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <new>
#include <utility>

namespace treetensor::tree::detail {

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kCacheNodes = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kCacheNodes = false;
#else
inline constexpr bool kCacheNodes = true;
#endif
#else
inline constexpr bool kCacheNodes = true;
#endif

/// Freed blocks by size class (class c holds blocks of 2^(c + kMinShift) bytes), each an
/// intrusive singly linked list through the blocks' first word.
class BlockCache {
 public:
  static constexpr std::size_t kMinShift = 6;  // 64-byte blocks and up
  static constexpr std::size_t kClasses = 15;  // ... up to 1 MiB
  static constexpr std::size_t kLargestCached = std::size_t{1} << (kMinShift + kClasses - 1);
  static constexpr std::size_t kCacheBytes = std::size_t{4} << 20;
  static constexpr std::size_t kClassBytes = std::size_t{1} << 20;

  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  /// This thread's cache, made on first use; nullptr once the thread's thread_locals are being
  /// destroyed (a tree freed after that, e.g. a static one, goes to operator delete).
  static BlockCache* mine() noexcept {
    if (state() == State::dead) return nullptr;
    thread_local BlockCache cache;
    return &cache;
  }

  /// The size class of a request of `bytes` (at most kLargestCached).
  static std::size_t class_of(std::size_t bytes) noexcept {
    const std::size_t rounded = std::bit_ceil(bytes < 64 ? std::size_t{64} : bytes);
    return static_cast<std::size_t>(std::countr_zero(rounded)) - kMinShift;
  }
  static std::size_t bytes_of(std::size_t cls) noexcept {
    return std::size_t{1} << (cls + kMinShift);
  }

  /// A cached block of class cls, or nullptr.
  void* take(std::size_t cls) noexcept {
    Block* b = heads_[cls];
    if (!b) return nullptr;
    heads_[cls] = b->next;
    held_ -= bytes_of(cls);
    class_held_[cls] -= bytes_of(cls);
    return b;
  }
  /// The bytes of the freed arrays this cache holds (at most kCacheBytes).
  std::size_t held() const noexcept { return held_; }
  /// Keeps p (a block of class cls) unless its class is full; false: the caller frees it. A
  /// full cache first frees blocks of the class holding the most bytes, so the sizes in use
  /// now displace those of trees dropped long ago.
  bool give(void* p, std::size_t cls) noexcept {
    const std::size_t bytes = bytes_of(cls);
    if (class_held_[cls] + bytes > kClassBytes) return false;
    while (held_ + bytes > kCacheBytes) evict_one(cls);
    heads_[cls] = ::new (p) Block{heads_[cls]};
    held_ += bytes;
    class_held_[cls] += bytes;
    return true;
  }

 private:
  enum class State : unsigned char { unused, alive, dead };
  struct Block {
    Block* next;
  };

  // Frees one block of the class (other than `keep`) holding the most bytes. Only called when
  // held_ > kCacheBytes - kClassBytes, so some other class holds a block.
  void evict_one(std::size_t keep) noexcept {
    std::size_t most = keep == 0 ? 1 : 0;
    for (std::size_t c = 0; c < kClasses; ++c)
      if (c != keep && class_held_[c] > class_held_[most]) most = c;
    ::operator delete(take(most));
  }

  BlockCache() noexcept { state() = State::alive; }
  ~BlockCache() {
    state() = State::dead;
    for (Block*& head : heads_)
      while (head) ::operator delete(std::exchange(head, head->next));
  }
  // Trivially destructible, so readable until the thread ends (after `cache` is destroyed).
  static State& state() noexcept {
    thread_local State s = State::unused;
    return s;
  }

  std::array<Block*, kClasses> heads_{};
  std::array<std::size_t, kClasses> class_held_{};
  std::size_t held_ = 0;
};

/// std::allocator's interface over BlockCache: arrays up to BlockCache::kLargestCached bytes are
/// rounded up to their size class and cached when freed; larger ones are operator new's.
template <class E>
struct NodeAllocator {
  using value_type = E;

  NodeAllocator() noexcept = default;
  template <class U>
  NodeAllocator(const NodeAllocator<U>&) noexcept {}  // NOLINT(google-explicit-constructor)

  E* allocate(std::size_t n) {
    if (n > SIZE_MAX / sizeof(E)) throw std::bad_array_new_length();
    const std::size_t bytes = n * sizeof(E);
    if (!kCacheNodes || bytes > BlockCache::kLargestCached)
      return static_cast<E*>(::operator new(bytes));
    const std::size_t cls = BlockCache::class_of(bytes);
    if (BlockCache* cache = BlockCache::mine())
      if (void* p = cache->take(cls)) return static_cast<E*>(p);
    return static_cast<E*>(::operator new(BlockCache::bytes_of(cls)));
  }
  void deallocate(E* p, std::size_t n) noexcept {
    const std::size_t bytes = n * sizeof(E);
    if (kCacheNodes && bytes <= BlockCache::kLargestCached)
      if (BlockCache* cache = BlockCache::mine())
        if (cache->give(p, BlockCache::class_of(bytes))) return;
    ::operator delete(p);
  }

  template <class U>
  bool operator==(const NodeAllocator<U>&) const noexcept {
    return true;  // any instance frees what another allocated
  }
};

}  // namespace treetensor::tree::detail
