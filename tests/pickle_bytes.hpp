#pragma once
// Pickle opcodes' operands as torch.save writes them (little-endian), for tests that build
// hostile or hand-made pickles byte by byte.

#include <cstdint>
#include <string>

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

}  // namespace pickle_bytes
