#pragma once
// A reader of the zip archives torch.save writes (stored records, optionally ZIP64), over
// untrusted bytes: every field of the end-of-central-directory record, the central directory
// and each local header is checked against the bytes present. Records are handed out as
// slices of the input (no copy); compressed records are refused (torch.save never writes them).

#include <map>
#include <string>

#include "io/bytes.hpp"

namespace treetensor::io::detail {

/// The records of a zip archive by name, each a slice of the input.
/// @throws IoError naming the file and offset when the archive is malformed or truncated.
std::map<std::string, Input> read_zip(const Input& archive);

/// Whether the bytes start like a zip archive (a local file header).
bool looks_like_zip(const Input& bytes);

}  // namespace treetensor::io::detail
