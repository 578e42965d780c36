#include "io/bytes.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string_view>

namespace treetensor::io {

namespace {
// The length of the well-formed UTF-8 sequence at s[i] (Python's strict decoder's rules: no
// overlong forms, no surrogates, nothing above U+10FFFF), 0 when there is none or it is NUL.
std::size_t utf8_sequence(std::string_view s, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = byte(0);
  const std::size_t n = c == 0                   ? 0  // valid, but a C string ends there
                        : c < 0x80               ? 1
                        : c >= 0xC2 && c <= 0xDF ? 2
                        : c >= 0xE0 && c <= 0xEF ? 3
                        : c >= 0xF0 && c <= 0xF4 ? 4
                                                 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k)
    if ((byte(k) & 0xC0) != 0x80) return 0;
  if ((c == 0xE0 && byte(1) < 0xA0) || (c == 0xED && byte(1) >= 0xA0) ||
      (c == 0xF0 && byte(1) < 0x90) || (c == 0xF4 && byte(1) >= 0x90))
    return 0;
  return n;
}

// A message that any UTF-8 reader (Python's str) takes: the bytes of a file's own strings or
// of a path that are not UTF-8 written as \xNN (Python's backslashreplace).
std::string valid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    if (const std::size_t n = utf8_sequence(s, i)) {
      out.append(s.substr(i, n));
      i += n;
      continue;
    }
    char escaped[5];
    std::snprintf(escaped, sizeof escaped, "\\x%02x", static_cast<unsigned char>(s[i++]));
    out += escaped;
  }
  return out;
}
}  // namespace

IoError::IoError(std::string file, std::optional<std::uint64_t> offset, const std::string& what)
    : std::runtime_error(valid_utf8(
          file + ": " + (offset ? "at byte " + std::to_string(*offset) + ": " : std::string()) +
          what)),
      file_(std::move(file)),
      offset_(offset) {}

namespace detail {

bool mul_ok(std::uint64_t a, std::uint64_t b, std::uint64_t& out) {
  return !__builtin_mul_overflow(a, b, &out);
}
bool add_ok(std::uint64_t a, std::uint64_t b, std::uint64_t& out) {
  return !__builtin_add_overflow(a, b, &out);
}

Input Input::slice(std::uint64_t offset, std::uint64_t n, const char* what) const {
  std::uint64_t end = 0;
  if (!add_ok(offset, n, end) || end > size)
    fail(offset, std::string(what) + " of " + std::to_string(n) + " bytes runs past the end (" +
                     std::to_string(size) + " bytes)");
  return Input{data + offset, n, name, map, views, meta};
}

c10::DataPtr Input::data_ptr(std::uint64_t offset, std::uint64_t n) const {
  const Input part = slice(offset, n, "tensor data");
  if (views && map) {
    // The DataPtr's context holds a reference to the mapping until the storage dies.
    auto* keep = new std::shared_ptr<FileMap>(map);
    return c10::DataPtr(
        map->writable(part.data), keep,
        [](void* ctx) { delete static_cast<std::shared_ptr<FileMap>*>(ctx); },
        c10::Device(c10::kCPU));
  }
  c10::DataPtr copy = c10::GetAllocator(c10::kCPU)->allocate(n);
  if (n && map)
    map->read(part.data, n, copy.get());
  else if (n)
    std::memcpy(copy.get(), part.data, n);
  return copy;
}

at::Storage Input::storage(std::uint64_t offset, std::uint64_t n) const {
  if (meta) {
    slice(offset, n, "tensor data");
    return at::Storage(at::Storage::use_byte_size_t(), n, c10::GetAllocator(c10::kMeta), true);
  }
  return at::Storage(at::Storage::use_byte_size_t(), n, data_ptr(offset, n), nullptr, false);
}

FileMap::FileMap(const std::string& path) : path_(path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; non-regular files are refused below.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0)
    throw IoError(path, std::nullopt, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    throw IoError(path, std::nullopt, "not a regular file");
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ == 0) return;
  // Read-only: a private writable mapping is commit-charged, so a file larger than memory
  // could not even be looked at.
  read_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
  if (read_ == MAP_FAILED) {
    const int err = errno;
    ::close(fd_);
    throw IoError(path, std::nullopt, std::string("cannot map: ") + std::strerror(err));
  }
}

FileMap::~FileMap() {
  if (read_) ::munmap(read_, size_);
  if (write_) ::munmap(write_, size_);
  ::close(fd_);
}

std::uint8_t* FileMap::writable(const std::uint8_t* p) {
  if (!write_) {
    // Writable so that a tensor written in place copies its page (on a read-only mapping the
    // write would be SIGSEGV); private so that the copy never reaches the file.
    void* q = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd_, 0);
    if (q == MAP_FAILED)
      throw IoError(path_, std::nullopt, std::string("cannot map: ") + std::strerror(errno));
    write_ = q;
  }
  return static_cast<std::uint8_t*>(write_) + (p - data());
}

void FileMap::read(const std::uint8_t* p, std::size_t n, void* out) const {
  // pread, not a copy from the mapping: the kernel copies from its page cache without faulting
  // in the mapping page by page, and a file truncated meanwhile is a short read, not SIGBUS.
  auto* dst = static_cast<std::uint8_t*>(out);
  auto offset = static_cast<off_t>(p - data());
  while (n > 0) {
    const ssize_t got = ::pread(fd_, dst, n, offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      throw IoError(path_, static_cast<std::uint64_t>(offset),
                    got < 0 ? std::string("cannot read: ") + std::strerror(errno)
                            : std::string("the file ends here: it changed while being loaded"));
    dst += got;
    offset += got;
    n -= static_cast<std::size_t>(got);
  }
}

Input map_file(const std::string& path, const LoadOptions& options) {
  auto map = std::make_shared<FileMap>(path);
  const bool meta = options.map_location && options.map_location->is_meta();
  return Input{map->data(), map->size(), path, map, options.mmap && !meta, meta};
}

namespace {
// Creates a file beside `path` that did not exist (O_EXCL: a name planted there, a symlink
// too, is never opened), mode 0666 less the umask as fopen gives; returns the fd (-1, errno).
int create_temporary(const std::string& path, std::string& tmp) {
  static std::atomic<std::uint64_t> counter{0};
  std::random_device entropy;
  for (int attempt = 0; attempt < 100; ++attempt) {
    const std::uint64_t r = (static_cast<std::uint64_t>(entropy()) << 32) ^ entropy() ^
                            (counter.fetch_add(1) * 0x9e3779b97f4a7c15ull);
    char suffix[17];
    std::snprintf(suffix, sizeof suffix, "%016llx", static_cast<unsigned long long>(r));
    tmp = path + ".tmp-" + suffix;
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  errno = EEXIST;
  return -1;
}

// Gives the temporary file the mode of the file it replaces (torch.save, writing in place,
// keeps a 0600 file 0600), then writes, flushes and fsyncs it and closes `fd`.
// False (errno set) on any failure.
bool fill(int fd, const std::string& path, const std::function<void(std::FILE*)>& write) {
  struct stat st {};
  std::FILE* f = nullptr;
  if ((::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
       ::fchmod(fd, st.st_mode & 07777) != 0) ||
      !(f = ::fdopen(fd, "wb"))) {
    const int err = errno;
    ::close(fd);
    errno = err;
    return false;
  }
  try {
    write(f);
  } catch (...) {
    std::fclose(f);
    throw;
  }
  const bool ok = std::fflush(f) == 0 && !std::ferror(f) && ::fsync(fd) == 0;
  const int err = errno;
  const bool closed = std::fclose(f) == 0;
  if (!ok) errno = err;
  return ok && closed;
}

// After the rename, the folder's entry is what a power loss must not lose: fsync the folder
// (best effort, as a folder that cannot be opened for reading still took the rename).
void sync_folder_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  const std::string folder = slash == std::string::npos ? "."
                             : slash == 0               ? "/"
                                                        : path.substr(0, slash);
  const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return;
  ::fsync(dir);
  ::close(dir);
}
}  // namespace

namespace {
// SIGPIPE held back on this thread while it lives: a FIFO whose reader went away makes a write
// fail with EPIPE (an IoError) instead of killing the process (Python ignores SIGPIPE; a C++
// program may not). A SIGPIPE raised meanwhile is taken off the thread before it is unblocked.
class NoSigpipe {
 public:
  NoSigpipe() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~NoSigpipe() {
    sigset_t pending;
    sigpending(&pending);
    if (!was_pending_ && sigismember(&pending, SIGPIPE) == 1) {
      const timespec now{0, 0};
      sigtimedwait(&pipe_, nullptr, &now);
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  NoSigpipe(const NoSigpipe&) = delete;
  NoSigpipe& operator=(const NoSigpipe&) = delete;

 private:
  sigset_t pipe_{}, old_{};
  bool was_pending_ = false;
};

// What torch.save's open(path, "wb") does, for a target a rename must not replace (a device,
// a FIFO, a hard-linked file, a symlink to one) or cannot (a folder this user may not create a
// file in): truncate and write through the existing entry; fsync only a regular file (a FIFO
// or device refuses it). Not atomic.
void write_in_place(const std::string& path, const std::function<void(std::FILE*)>& write) {
  const NoSigpipe no_sigpipe;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  std::FILE* f = fd < 0 ? nullptr : ::fdopen(fd, "wb");
  if (!f) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    throw IoError(path, std::nullopt,
                  std::string("cannot open for writing: ") + std::strerror(err));
  }
  try {
    write(f);
  } catch (...) {
    std::fclose(f);
    throw;
  }
  struct stat st {};
  bool ok = std::fflush(f) == 0 && !std::ferror(f) && ::fstat(fd, &st) == 0 &&
            (!S_ISREG(st.st_mode) || ::fsync(fd) == 0);
  int err = errno;
  if (std::fclose(f) != 0 && ok) ok = false, err = errno;
  if (!ok) throw IoError(path, std::nullopt, std::string("cannot write: ") + std::strerror(err));
}

// The regular file a symlink leads to, resolved by the kernel's own walk (open O_PATH: its
// protected_symlinks check applies, as to torch.save's open), or empty: a link to anything
// else, a dangling link, a file with other hard links, a link the walk refuses.
std::string link_target(const std::string& path) {
  const int fd = ::open(path.c_str(), O_PATH | O_CLOEXEC);
  if (fd < 0) return {};
  struct stat st {};
  std::string resolved(4096, '\0');
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 1
                        ? ::readlink(proc.c_str(), resolved.data(), resolved.size())
                        : -1;
  ::close(fd);
  if (n <= 0 || static_cast<std::size_t>(n) >= resolved.size()) return {};
  resolved.resize(static_cast<std::size_t>(n));
  return resolved;
}

// Where replace_file renames to: `path`, or a symlink's regular file (the link stays a link);
// empty when a rename would change what the entry is (a device, a FIFO, a socket, a file with
// other hard links, a symlink to none of a regular file), which is then written in place.
std::string rename_target(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return path;  // a new file (or an error the write names)
  if (S_ISLNK(st.st_mode)) return link_target(path);
  return S_ISREG(st.st_mode) && st.st_nlink == 1 ? path : std::string();
}
}  // namespace

void replace_file(const std::string& target, const std::function<void(std::FILE*)>& write) {
  if (target.find('\0') != std::string::npos)  // the system would write to the name before it
    throw IoError(target, std::nullopt, "the path holds a NUL byte");
  const std::string path = rename_target(target);
  if (path.empty()) return write_in_place(target, write);
  std::string tmp;
  const int fd = create_temporary(path, tmp);
  if (fd < 0 &&
      (errno == EACCES || errno == EPERM))  // a folder closed to new files: torch.save's way
    return write_in_place(target, write);
  if (fd < 0)
    throw IoError(target, std::nullopt,
                  std::string("cannot create a temporary file beside it: ") + std::strerror(errno));
  bool ok = false;
  try {
    ok = fill(fd, path, write) && ::rename(tmp.c_str(), path.c_str()) == 0;
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (!ok) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw IoError(target, std::nullopt, std::string("cannot write: ") + std::strerror(err));
  }
  sync_folder_of(path);
}

std::uint8_t Cursor::u8(const char* what) {
  if (left() < 1) fail(std::string("the input ends where ") + what + " was expected");
  return b_.data[pos_++];
}

std::uint64_t Cursor::le(int n, const char* what) {
  const std::string_view s = take(n, what);
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<std::uint8_t>(s[i]);
  return v;
}

std::uint64_t Cursor::be(int n, const char* what) {
  const std::string_view s = take(n, what);
  std::uint64_t v = 0;
  for (int i = 0; i < n; ++i) v = (v << 8) | static_cast<std::uint8_t>(s[i]);
  return v;
}

std::string_view Cursor::take(std::uint64_t n, const char* what) {
  if (n > left())
    fail(std::string("the input ends inside ") + what + " (" + std::to_string(n) +
         " bytes wanted, " + std::to_string(left()) + " left)");
  const auto* p = reinterpret_cast<const char*>(b_.data + pos_);
  pos_ += n;
  return {p, static_cast<std::size_t>(n)};
}

}  // namespace detail
}  // namespace treetensor::io
