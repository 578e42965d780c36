#pragma once
// safetensors files (huggingface/safetensors format): an 8-byte little-endian header length N,
// N bytes of UTF-8 JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {str: str}}, then the data. Tensor names are dotted tree paths ("a.b.c").
//
// Checks (those of the reference reader, safetensors/src/tensor.rs `validate`): N <= 100 MB and
// within the file; the header is valid UTF-8 JSON with no duplicate keys; every entry has a
// known dtype, a shape and two offsets; offsets are contiguous from 0 with no gap or overlap and
// the last ends where the file does; each byte size equals numel × the dtype's size (overflow
// checked). Every safetensors dtype loads, F8_E4M3/F8_E5M2/U16/U32/U64 as PyTorch 2.x's
// float8_e4m3fn/float8_e5m2/uint16/uint32/uint64.
// Errors are io::IoError naming the file, the offset and the tensor.
//
// Memory and saving as checkpoint.hpp says: tensors are copies (nothing done to the file after
// loading reaches them); with LoadOptions::mmap each tensor views a private mapping when its data
// offset is a multiple of its element size (writers, this one too, pad the header to 8 bytes,
// so this is the usual case; a misaligned tensor is copied), with LoadOptions::mmap's hazard;
// with map_location meta, the tensors are on the meta device and no data is read.
// Saving is atomic, keeps the target's mode, and leaves it as it was on any failure; a symlink,
// a device, a FIFO or a hard-linked file is written as checkpoint.hpp says.

#include <map>
#include <string>

#include "treetensor/io/checkpoint.hpp"
#include "treetensor/tensor/tree_tensor.hpp"

namespace treetensor::io {

/// A safetensors file's tensors (at the paths their dotted names give) and its __metadata__.
struct SafetensorsFile {
  TreeTensor tensors;
  std::map<std::string, std::string> metadata;
};

/// Reads a safetensors file. @throws IoError on any failed check (see above);
/// std::invalid_argument when the names cannot form a tree (as from_state_dict()).
SafetensorsFile load_safetensors(const std::string& path, const LoadOptions& options = {});

/// Writes `tensors` (contiguous copies where needed, in flatten order, names = dotted paths) and
/// `metadata`. @throws IoError when the file cannot be written; std::invalid_argument for a key
/// that is empty or contains '.', or a dtype safetensors has no name for.
void save_safetensors(const std::string& path, const TensorTree& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace treetensor::io
