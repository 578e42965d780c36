#pragma once
// Bytes of a file for the readers of untrusted input (DESIGN.md §13): a span that names its file,
// a bounds-checked cursor whose every failure is an IoError naming file and offset, and a
// private memory mapping that tensors may view.

#include <c10/core/Allocator.h>
#include <c10/core/Storage.h>

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

/// A file mapped read-only (PROT_READ, so even a huge file maps without a commit charge), and on
/// request a second, writable private mapping (copy-on-write) that tensors view
/// (LoadOptions::mmap).
class FileMap {
 public:
  /// @throws IoError naming the file when it cannot be opened, is not a regular file, or mapped.
  explicit FileMap(const std::string& path);
  FileMap(const FileMap&) = delete;
  FileMap& operator=(const FileMap&) = delete;
  ~FileMap();
  const std::uint8_t* data() const { return static_cast<const std::uint8_t*>(read_); }
  std::size_t size() const { return size_; }
  /// Copies the n bytes at `p` (within data()) into `out`, read from the file.
  /// @throws IoError naming the file and offset when they cannot be read.
  void read(const std::uint8_t* p, std::size_t n, void* out) const;
  /// The byte at `p` (within data()) in the writable private mapping, made on first use.
  /// @throws IoError naming the file when it cannot be mapped.
  std::uint8_t* writable(const std::uint8_t* p);

 private:
  std::string path_;
  int fd_ = -1;
  std::size_t size_ = 0;
  void* read_ = nullptr;
  void* write_ = nullptr;
};

/// Bytes of one input (a mapped file, or memory for tests and fuzzing) and its name.
struct Input {
  const std::uint8_t* data = nullptr;
  std::size_t size = 0;
  std::string name;
  /// Keeps `data` alive when it is a file's mapping; empty for memory input.
  std::shared_ptr<FileMap> map;
  /// Tensors view `map`'s writable private mapping instead of copying (LoadOptions::mmap).
  bool views = false;
  /// Storages are made on the meta device: sizes checked, no byte of data read or allocated
  /// (LoadOptions::map_location = meta, as torch.load(map_location="meta")).
  bool meta = false;

  [[noreturn]] void fail(std::uint64_t offset, const std::string& what) const {
    throw IoError(name, offset, what);
  }
  /// The bytes [offset, offset + n), checked; `what` names them in the error.
  Input slice(std::uint64_t offset, std::uint64_t n, const char* what) const;
  /// A DataPtr for [offset, offset + n): a view sharing `map` when `views`, else a copy.
  c10::DataPtr data_ptr(std::uint64_t offset, std::uint64_t n) const;
  /// The storage of [offset, offset + n): on the meta device when `meta` (resizable, as
  /// set_() on a meta tensor requires), else over data_ptr().
  at::Storage storage(std::uint64_t offset, std::uint64_t n) const;
};

/// The file, mapped read-only, its tensors' data copied, viewed (LoadOptions::mmap) or not read
/// at all (map_location meta) as `options` say.
/// @throws IoError naming the file when it cannot be opened, is not a regular file, or mapped.
Input map_file(const std::string& path, const LoadOptions& options);

/// Writes a file as `write(FILE*)` fills it, atomically: into a new temporary file beside
/// `path` (a random name, created O_EXCL|O_NOFOLLOW, so nothing planted there is followed),
/// flushed and fsynced, then renamed over `path` (and the folder fsynced, so the rename survives
/// a power loss). An existing `path` keeps its permission bits;
/// a new one gets 0666 & ~umask, as fopen would give it. Readers see the old file or the new
/// one, never a part; concurrent writers each replace the whole file. On any failure the
/// temporary file is removed and `path` is left as it was. A symlink to a regular file (as the
/// kernel's walk resolves it, protected_symlinks included): that file is replaced so, the link
/// stays. Where a rename would change what the entry is (a device such as /dev/null, a FIFO, a
/// file with other hard links, a symlink to none of a regular file) or no file can be created
/// beside it (EACCES, EPERM), `path` is written in place instead, truncated, as torch.save's
/// open(path, "wb") does: not atomic (a failure leaves a part; concurrent writers interleave),
/// with SIGPIPE held back on the calling thread (a FIFO's reader gone is an EPIPE IoError).
/// @throws IoError naming `path` as given when it holds a NUL byte, the temporary file cannot be
/// created, written,
///         synced or renamed, or the in-place target cannot be opened or written (and whatever
///         `write` throws, after the clean-up).
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
