// Zip archive reading (APPNOTE.TXT 6.3: 4.3.7 local header, 4.3.12 central directory, 4.3.14-16
// end records, 4.5.3 ZIP64 extra field), as torch.save's writer (miniz) produces.
#include "io/zip.hpp"

#include <algorithm>

namespace treetensor::io::detail {
namespace {

constexpr std::uint32_t kLocal = 0x04034b50, kCentral = 0x02014b50, kEnd = 0x06054b50,
                        kEnd64 = 0x06064b50, kLocator64 = 0x07064b50;

struct Directory {
  std::uint64_t entries = 0, offset = 0, size = 0;
};

// The end-of-central-directory record: the last signature within 64 KiB + 22 bytes of the end.
std::uint64_t find_end(const Input& b) {
  if (b.size < 22) b.fail(0, "too short for a zip archive (no end of central directory)");
  const std::uint64_t lowest = b.size > 22 + 65535 ? b.size - 22 - 65535 : 0;
  for (std::uint64_t p = b.size - 22;; --p) {
    Cursor c(b, p);
    if (c.le(4, "a signature") == kEnd) return p;
    if (p == lowest) break;
  }
  b.fail(b.size, "no end of central directory record: not a zip archive, or truncated");
}

Directory read_directory(const Input& b) {
  const std::uint64_t end = find_end(b);
  Cursor c(b, end + 8);
  Directory d;
  c.le(2, "the entries on this disk");
  d.entries = c.le(2, "the entry count");
  d.size = c.le(4, "the directory size");
  d.offset = c.le(4, "the directory offset");
  if (d.entries == 0xffff || d.size == 0xffffffff || d.offset == 0xffffffff) {
    if (end < 20) b.fail(end, "a ZIP64 archive without its locator");
    Cursor loc(b, end - 20);
    if (loc.le(4, "the ZIP64 locator") != kLocator64) loc.fail_at(end - 20, "no ZIP64 end locator");
    loc.le(4, "the disk number");
    const std::uint64_t at = loc.le(8, "the ZIP64 end offset");
    Cursor z(b, at);
    if (at >= b.size || z.le(4, "the ZIP64 end record") != kEnd64)
      z.fail_at(at, "no ZIP64 end of central directory record");
    z.le(8, "the record size");
    z.le(4, "versions");
    z.le(8, "disk numbers");
    z.le(8, "the entries on this disk");
    d.entries = z.le(8, "the entry count");
    d.size = z.le(8, "the directory size");
    d.offset = z.le(8, "the directory offset");
  }
  std::uint64_t dir_end = 0;
  if (!add_ok(d.offset, d.size, dir_end) || dir_end > b.size)
    b.fail(end, "the central directory (" + std::to_string(d.size) + " bytes at " +
                    std::to_string(d.offset) + ") lies outside the file");
  // Each entry is at least 46 bytes: a count the directory cannot hold is a lie.
  if (d.entries > d.size / 46) b.fail(end, "more entries than the central directory can hold");
  return d;
}

// The ZIP64 extra field's sizes/offset for the fields that were 0xffffffff.
void zip64_extra(Cursor extra, std::uint64_t& size, std::uint64_t& csize, std::uint64_t& offset,
                 std::uint64_t extra_end) {
  while (extra.pos() + 4 <= extra_end) {
    const auto id = extra.le(2, "an extra field id");
    const auto len = extra.le(2, "an extra field length");
    const std::uint64_t next = extra.pos() + len;
    if (next > extra_end) extra.fail("an extra field runs past its entry");
    if (id == 1) {
      if (size == 0xffffffff) size = extra.le(8, "the ZIP64 size");
      if (csize == 0xffffffff) csize = extra.le(8, "the ZIP64 compressed size");
      if (offset == 0xffffffff) offset = extra.le(8, "the ZIP64 offset");
      return;
    }
    extra.take(len, "an extra field");
  }
}

Input record(const Input& b, Cursor& c, std::string& name) {
  const std::uint64_t at = c.pos();
  if (c.le(4, "a central directory entry") != kCentral)
    c.fail_at(at, "not a central directory entry");
  c.take(6, "versions and flags");
  const auto method = c.le(2, "the compression method");
  c.take(8, "time and CRC");
  std::uint64_t csize = c.le(4, "the compressed size");
  std::uint64_t size = c.le(4, "the size");
  const auto name_len = c.le(2, "the name length");
  const auto extra_len = c.le(2, "the extra length");
  const auto comment_len = c.le(2, "the comment length");
  c.take(8, "disk and attributes");
  std::uint64_t local = c.le(4, "the local header offset");
  name.assign(c.take(name_len, "the record name"));
  const std::uint64_t extra_at = c.pos();
  c.take(extra_len, "the extra field");
  zip64_extra(Cursor(b, extra_at), size, csize, local, extra_at + extra_len);
  c.take(comment_len, "the comment");
  if (method != 0)
    b.fail(at, "record '" + name + "' is compressed (method " + std::to_string(method) +
                   "); torch.save writes stored records only");
  if (csize != size) b.fail(at, "record '" + name + "' has two different sizes");
  Cursor l(b, local);
  if (local >= b.size || l.le(4, "a local header") != kLocal)
    b.fail(local, "record '" + name + "' has no local header there");
  l.take(22, "the local header");
  const auto lname = l.le(2, "the local name length");
  const auto lextra = l.le(2, "the local extra length");
  l.take(lname + lextra, "the local name and extra field");
  return b.slice(l.pos(), size, ("record '" + name + "'").c_str());
}

}  // namespace

bool looks_like_zip(const Input& bytes) {
  return bytes.size >= 4 && Cursor(bytes).le(4, "a signature") == kLocal;
}

std::map<std::string, Input> read_zip(const Input& archive) {
  const Directory d = read_directory(archive);
  std::map<std::string, Input> out;
  std::map<const std::uint8_t*, std::string> starts;  // non-empty records by first byte
  Cursor c(archive, d.offset);
  for (std::uint64_t i = 0; i < d.entries; ++i) {
    std::string name;
    const std::uint64_t at = c.pos();
    Input r = record(archive, c, name);
    if (r.size > 0 && !starts.emplace(r.data, name).second)
      archive.fail(at, "records '" + starts[r.data] + "' and '" + name + "' share their bytes");
    if (!out.emplace(name, std::move(r)).second)
      archive.fail(at, "record '" + name + "' appears twice");
  }
  // Records must not overlap (torch.save writes each once): otherwise one file could stand
  // for many storages, each loaded or copied again.
  const std::uint8_t* end = nullptr;
  std::string previous;
  for (const auto& [start, name] : starts) {
    if (end && start < end)
      archive.fail(static_cast<std::uint64_t>(start - archive.data),
                   "records '" + previous + "' and '" + name + "' overlap");
    end = start + out.at(name).size;
    previous = name;
  }
  return out;
}

}  // namespace treetensor::io::detail
