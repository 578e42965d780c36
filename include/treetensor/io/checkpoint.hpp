#pragma once
// PyTorch checkpoint files: what Python's torch.save writes and torch.load reads (DESIGN.md §11,
// §13), read by treetensor's own allowlisted unpickler (as torch.load(weights_only=True)).
//
// Formats read: the zip format (torch.save's default since 1.6; PyTorch 2.x's additions:
// `_rebuild_tensor_v3`, UntypedStorage, the `byteorder` record) and the legacy stream format
// (`_use_new_zipfile_serialization=False`: magic number, protocol, sys info, object, storage
// keys, raw storages). Format written: the zip format, which torch.load of PyTorch 1.13 and 2.x
// opens (records stored uncompressed, 64-byte aligned, as PyTorch's writer does).
//
// Safety (what torch.load(weights_only=True) allows, torch/_weights_only_unpickler.py): only the
// pickle opcodes torch.save emits, and only these globals: torch._utils._rebuild_tensor_v2/v3,
// _rebuild_parameter(_with_state), collections.OrderedDict, the torch.*Storage classes and
// UntypedStorage, torch.Size, torch.device, the torch dtypes, _codecs.encode,
// __builtin__/builtins set, complex, bytes. Anything else is refused naming the global. Every
// length, index, offset, size, stride and element count is checked (with overflow checks)
// against the bytes present before anything is allocated; nesting deeper than 1000 is refused.
// A pickle may place one object at many paths (memo references); the tree holds a copy at each,
// so what loading builds beyond the pickle's own objects (tree entries, strings, keys, the paths
// recorded in Object's maps, re-read sizes) is limited to 128 bytes per pickle byte plus 64 MiB,
// tensor data aside: past that, IoError "... the object made at byte <offset> would expand to
// more than <n> bytes in memory ...". Shared tensors (tied weights) cost one tensor header per
// path, far within it. A malformed or hostile file raises IoError naming the file, the byte
// offset and what was expected; it never crashes, hangs or allocates more than the file implies.
//
// Loading (as torch.load): the file is mapped read-only to read its structure and each storage
// is copied into memory, so once load() returns, nothing done to the file (truncated, rewritten
// in place, replaced) reaches the loaded tensors, and writing a tensor never reaches the file.
// With LoadOptions::mmap (torch.load(mmap=True)) tensors view a private mapping instead: see
// there for what that allows; with map_location meta no data is read at all (the structure
// alone, for files larger than memory). The file must not change while load() runs.
//
// Saving: atomic for a regular file (or a new path). The archive goes to a new temporary file
// beside the target (a random name created O_EXCL|O_NOFOLLOW: a symlink planted there is not
// followed), is fsynced and renamed over the target, which keeps its permission bits (a new
// file gets 0666 & ~umask). A reader sees the old file or the new one; of two concurrent saves
// to one path, one whole file wins. On any failure (a full disk, too) save() throws IoError,
// removes its temporary file and leaves the target as it was. A symlink's regular file is
// replaced so (the link stays). A target a rename would change (a device such as /dev/null, a
// FIFO, a file with other hard links), or one in a folder where no file can be created, is
// written in place, truncated, as torch.save writes it: not atomic (a failure leaves a part),
// and a FIFO whose reader is gone is an IoError (SIGPIPE is held back), never a death.
//
// Thread safety: calls on different files may run concurrently.

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "treetensor/io/object.hpp"

namespace treetensor::io {

/// A file that cannot be read or written: names the file, the byte offset (when one applies)
/// and what was expected. Message: "<file>: at byte <offset>: <what>" or "<file>: <what>",
/// valid UTF-8 without NUL (bytes of the path or of the file's strings that are not UTF-8, and NUL,
/// are written \xNN, as Python's backslashreplace); file() is the path as given.
class IoError : public std::runtime_error {
 public:
  IoError(std::string file, std::optional<std::uint64_t> offset, const std::string& what);
  const std::string& file() const noexcept { return file_; }
  std::optional<std::uint64_t> offset() const noexcept { return offset_; }

 private:
  std::string file_;
  std::optional<std::uint64_t> offset_;
};

/// Options of load() (torch.load's map_location, for one device).
struct LoadOptions {
  /// Where tensors go; unset: the CPU (the file's own locations, "cuda:0", are not honoured:
  /// this LibTorch may have no such device; torch.load refuses a CUDA location without CUDA,
  /// and moves to it with CUDA. A location that names no device is refused, as torch.load
  /// refuses it). The meta device (`c10::kMeta`), as
  /// torch.load(map_location="meta"): every tensor with its dtype, shape, stride and storage
  /// size, on the meta device, and no byte of tensor data read, copied or mapped, so a file
  /// larger than memory loads in the time its structure takes (treetensor-inspect loads so).
  std::optional<c10::Device> map_location;
  /// torch.load(mmap=True): tensors view a private, copy-on-write mapping of the file instead
  /// of copies, so loading reads only the structure and pages are read when first touched.
  /// Writing a tensor copies its pages and never reaches the file. The hazard: the pages not
  /// yet written are the file's own, so while the tensors live, rewriting the file in place
  /// changes their values, and truncating it makes reading them raise SIGBUS (saving with
  /// save() or torch.save to a temporary file and renaming is safe). The mapping is writable,
  /// so it counts against the commit limit: a file larger than memory may fail to map.
  bool mmap = false;
  LoadOptions& device(c10::Device d) {
    map_location = d;
    return *this;
  }
  LoadOptions& mapped(bool on = true) {
    mmap = on;
    return *this;
  }
};

/// Everything a torch.save file holds (zip or legacy format, detected from the first bytes).
/// @throws IoError when the file cannot be opened or is malformed, truncated or refused.
Object load(const std::string& path, const LoadOptions& options = {});

/// The tensors of a torch.save file at their paths in the file (as Object::tensors()).
TreeTensor load_tensors(const std::string& path, const LoadOptions& options = {});

/// A state dict file (`torch.save(model.state_dict())`) as a tree: the dotted keys become paths
/// ("layer1.0.weight" → layer1 / 0 / weight), as from_state_dict() builds them; non-tensor
/// values are left out. @throws IoError as load(); std::invalid_argument when the keys cannot
/// form a tree (one key a prefix of another's path, as from_state_dict()).
TreeTensor load_state_dict(const std::string& path, const LoadOptions& options = {});

/// Writes `object` in the zip format, as torch.save does: containers as recorded in `kinds`,
/// integer keys as ints, Parameters as nn.Parameter, tensors that share a storage written once
/// (views keep their offset, size and stride). Tensors on another device are copied to the CPU
/// for writing and recorded with their device's location, as torch.save does.
/// @throws IoError when the file cannot be written; std::invalid_argument when a key recorded
///         as an int is not a decimal int64, or a list's keys are not 0..n-1.
void save(const std::string& path, const Object& object);

/// Writes a tree of tensors as nested dicts (Python reads `{'a': tensor, 'b': {'c': ...}}`).
void save(const std::string& path, const TensorTree& tree);

/// Writes a tree as a flat state dict, an OrderedDict keyed by dotted paths
/// ("layer1.0.weight"), which `model.load_state_dict(torch.load(path))` accepts.
/// @throws std::invalid_argument when a key is empty or contains '.' (to_state_dict's rule).
void save_state_dict(const std::string& path, const TensorTree& tree);

}  // namespace treetensor::io
