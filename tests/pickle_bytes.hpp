#pragma once
// Pickle opcodes' operands as torch.save writes them (little-endian), for tests that build
// hostile or hand-made pickles byte by byte.

#include <cstdint>
#include <string>
#include <vector>

namespace pickle_bytes {

/// A 4-byte little-endian unsigned integer.
inline std::string u32(std::uint32_t v) {
  std::string s(4, '\0');
  for (int k = 0; k < 4; ++k) s[k] = static_cast<char>((v >> (8 * k)) & 0xff);
  return s;
}

/// BINUNICODE: a str of `s`'s bytes.
inline std::string str(const std::string& s) {
  return "X" + u32(static_cast<std::uint32_t>(s.size())) + s;
}

/// LONG1 of 8 bytes: an int64.
inline std::string integer(std::int64_t v) {
  std::string s = "\x8a\x08";
  for (int k = 0; k < 8; ++k)
    s += static_cast<char>((static_cast<std::uint64_t>(v) >> (8 * k)) & 0xff);
  return s;
}
/// A tuple of int64s.
inline std::string ints(const std::vector<std::int64_t>& v) {
  std::string s = "(";
  for (auto x : v) s += integer(x);
  return s + "t";
}
/// {'t': _rebuild_tensor_v2(('storage', <cls>, '0', <location>, numel), offset, size, stride,
/// grad, {})}
inline std::string tensor_pickle(std::vector<std::int64_t> size, std::vector<std::int64_t> stride,
                                 std::int64_t offset = 0, std::int64_t numel = 2,
                                 const std::string& cls = "FloatStorage", bool grad = false,
                                 const std::string& location = "cpu") {
  return std::string("\x80\x02}(") + str("t") + "ctorch._utils\n_rebuild_tensor_v2\n((" +
         str("storage") + "ctorch\n" + cls + "\n" + str("0") + str(location) + integer(numel) +
         "tQ" + integer(offset) + ints(size) + ints(stride) + (grad ? "\x88" : "\x89") +
         "ccollections\nOrderedDict\n)RtRu.";
}

/// A legacy-format torch.save file (`_use_new_zipfile_serialization=False`) up to the data of
/// its one storage, key '0' of `numel` elements, which `object` (e.g. tensor_pickle) refers to:
/// magic number, protocol 1001, sys info {}, the object, the storage keys ['0'], the storage's
/// element count. The caller appends numel × the element size bytes (or a hole, ftruncate).
inline std::string legacy_head(const std::string& object, std::int64_t numel) {
  const std::string magic("\x80\x02\x8a\x0al\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.", 15);
  const std::string count = integer(numel).substr(2);  // 8 bytes, little-endian
  return magic + "\x80\x02M\xe9\x03." + "\x80\x02}." + object + "\x80\x02](" + str("0") + "e." +
         count;
}

}  // namespace pickle_bytes
