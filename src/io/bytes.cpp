#include "io/bytes.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace treetensor::io {

IoError::IoError(std::string file, std::optional<std::uint64_t> offset, const std::string& what)
    : std::runtime_error(file + ": " +
                         (offset ? "at byte " + std::to_string(*offset) + ": " : std::string()) +
                         what),
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
  return Input{data + offset, n, name, owner};
}

c10::DataPtr Input::data_ptr(std::uint64_t offset, std::uint64_t n) const {
  const Input part = slice(offset, n, "tensor data");
  if (owner) {
    // The DataPtr's context holds a reference to the mapping until the storage dies.
    auto* keep = new std::shared_ptr<void>(owner);
    return c10::DataPtr(
        const_cast<std::uint8_t*>(part.data), keep,
        [](void* ctx) { delete static_cast<std::shared_ptr<void>*>(ctx); }, c10::Device(c10::kCPU));
  }
  c10::DataPtr copy = c10::GetAllocator(c10::kCPU)->allocate(n);
  if (n) std::memcpy(copy.get(), part.data, n);
  return copy;
}

Input map_file(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; non-regular files are refused below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    throw IoError(path, std::nullopt, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError(path, std::nullopt, "not a regular file");
  }
  const auto size = static_cast<std::size_t>(st.st_size);
  void* p = nullptr;
  if (size > 0) {
    p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      throw IoError(path, std::nullopt, std::string("cannot map: ") + std::strerror(err));
    }
  }
  ::close(fd);
  std::shared_ptr<void> owner(p, [size](void* q) {
    if (q) ::munmap(q, size);
  });
  return Input{static_cast<const std::uint8_t*>(p), size, path, std::move(owner)};
}

void replace_file(const std::string& path, const std::function<void(std::FILE*)>& write) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw IoError(path, std::nullopt, std::string("cannot write: ") + std::strerror(errno));
  bool ok = false;
  try {
    write(f);
    ok = std::fflush(f) == 0 && !std::ferror(f);
  } catch (...) {
    std::fclose(f);
    std::remove(tmp.c_str());
    throw;
  }
  ok = std::fclose(f) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    throw IoError(path, std::nullopt, std::string("cannot write: ") + std::strerror(err));
  }
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
