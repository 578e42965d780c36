#pragma once
// Bytes of a file for the readers of untrusted input (DESIGN.md §13): a span that names its file,
// a bounds-checked cursor whose every failure is an IoError naming file and offset, and a
// private memory mapping that tensors may view.

#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "treetensor/io/checkpoint.hpp"
#include "treetensor/io/safetensors.hpp"

namespace treetensor::io::detail {

/// Bytes of one input (a mapped file, or memory for tests and fuzzing) and its name.
struct Input {
  const std::uint8_t* data = nullptr;
  std::size_t size = 0;
  std::string name;
  /// Keeps `data` alive; tensors that view the bytes share it. May be empty (memory input).
  std::shared_ptr<void> owner;

  [[noreturn]] void fail(std::uint64_t offset, const std::string& what) const {
    throw IoError(name, offset, what);
  }
  /// The bytes [offset, offset + n), checked; `what` names them in the error.
  Input slice(std::uint64_t offset, std::uint64_t n, const char* what) const;
  /// A DataPtr for [offset, offset + n) sharing `owner` (zero-copy when owned, else a copy).
  c10::DataPtr data_ptr(std::uint64_t offset, std::uint64_t n) const;
};

/// The file, mapped privately (copy-on-write, so writes through tensors never reach it).
/// @throws IoError naming the file when it cannot be opened, is not a regular file, or mapped.
Input map_file(const std::string& path);

/// Writes a file as `write(FILE*)` fills it: into a temporary file beside `path`, renamed over
/// `path` only when complete. A file being replaced may be the one a loaded tree views (its
/// mapping keeps the old contents); a failed write leaves `path` as it was.
/// @throws IoError naming `path` when the temporary file cannot be written or renamed.
void replace_file(const std::string& path, const std::function<void(std::FILE*)>& write);

/// A forward cursor over an Input: every read is bounds-checked.
class Cursor {
 public:
  explicit Cursor(const Input& bytes, std::uint64_t start = 0) : b_(bytes), pos_(start) {}
  std::uint64_t pos() const { return pos_; }
  std::uint64_t left() const { return b_.size - pos_; }
  bool at_end() const { return pos_ >= b_.size; }
  std::uint8_t u8(const char* what);
  std::uint64_t le(int n, const char* what);  ///< n-byte little-endian unsigned
  std::uint64_t be(int n, const char* what);  ///< n-byte big-endian unsigned
  std::string_view take(std::uint64_t n, const char* what);
  [[noreturn]] void fail(const std::string& what) const { b_.fail(pos_, what); }
  [[noreturn]] void fail_at(std::uint64_t offset, const std::string& what) const {
    b_.fail(offset, what);
  }
  const Input& bytes() const { return b_; }

 private:
  const Input& b_;
  std::uint64_t pos_;
};

/// a * b and a + b on sizes, or nullopt-like failure: returns false on overflow.
bool mul_ok(std::uint64_t a, std::uint64_t b, std::uint64_t& out);
bool add_ok(std::uint64_t a, std::uint64_t b, std::uint64_t& out);

/// The readers on bytes already in memory (load() and load_safetensors() map the file first);
/// the fuzz driver calls these. Same errors as the public functions.
Object load_from_bytes(const Input& file);
SafetensorsFile safetensors_from_bytes(const Input& file, const LoadOptions& options = {});

}  // namespace treetensor::io::detail
