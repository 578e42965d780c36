#pragma once
// treetensor's own pickle reader and writer for torch.save's object pickles (DESIGN.md §13).
//
// The reader is one opcode loop over a bounds-checked cursor with an allowlist of opcodes (those
// torch.save emits at protocol 2, and the protocol-4 framing ops) and of globals (as
// torch/_weights_only_unpickler.py); it never imports or calls anything else. Python objects
// live in an arena owned by the reader, so a hostile pickle's reference cycles cannot leak, and
// are converted into an Object after the storages are known (legacy files put the storages
// after the pickle).
//
// Expansion budget: one arena entry per opcode at most, but a memo reference (BINGET) puts an
// existing object at a second place, and the tree built from it holds a copy at every place
// (with its path recorded in the Object's maps). What such copies cost while reading (a memo'd
// string re-encoded, a tensor's size re-read) and everything the conversion builds (tree
// entries, strings, keys, recorded paths) is charged in bytes against
// kExpansionPerByte × pickle bytes + kExpansionBase; past it, an IoError names the offset of the
// op whose object would expand too far.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <complex>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "io/bytes.hpp"
#include "treetensor/io/object.hpp"

namespace treetensor::io::detail {

/// The expansion budget (see above): bytes of memory per pickle byte, plus a base that lets
/// small files nest 1000 deep.
constexpr std::uint64_t kExpansionPerByte = 128;
constexpr std::uint64_t kExpansionBase = std::uint64_t{64} << 20;

/// A storage that a pickle refers to through a persistent id.
struct StorageRef {
  std::string key;          ///< record name (zip: data/<key>) or legacy storage key
  c10::ScalarType dtype;    ///< from the storage class (or v3's dtype argument)
  std::uint64_t numel = 0;  ///< elements, as the persistent id says
  std::string location;     ///< "cpu", "cuda:0", ...
};

enum class Kind : std::uint8_t {
  none,
  boolean,
  integer,
  floating,
  complex,
  str,
  bytes,
  tuple,
  list,
  dict,
  ordered_dict,
  set,
  global,
  dtype,
  device,
  storage,
  tensor
};

// What an allowlisted global is, when called (REDUCE) or used as a value.
enum class Global : std::uint8_t {
  ordered_dict,
  rebuild_v2,
  rebuild_v3,
  rebuild_parameter,
  rebuild_parameter_state,
  storage_class,
  size,
  device,
  dtype,
  codecs_encode,
  set,
  complex,
  bytes,
  tree  // treetensor.torch._tree: how torch.save pickles a tree (its nested dict)
};

/// One Python object of an unpickled stream (an arena entry).
struct PyNode {
  Kind kind = Kind::none;
  bool flag = false;  // bool value; tensor: requires_grad
  bool parameter = false;
  bool conj = false, neg = false;  // tensor: torch's conjugate and negative view bits
  Global global{};
  c10::ScalarType dtype = c10::kFloat;  // dtype value, storage class, tensor dtype
  std::int64_t i = 0;                   // int; tensor: storage offset; storage: index
  double re = 0, im = 0;
  std::string s;                     // str, bytes, global name, device text
  std::vector<std::uint32_t> items;  // tuple/list/set; dict: key, value, key, value, ...
  std::vector<std::int64_t> size, stride;
  std::uint64_t at = 0;  // the offset of the op that made it, for messages
};

/// The result of reading one object pickle.
class Unpickled {
 public:
  /// The storages referred to, in first-seen order (each key once).
  const std::vector<StorageRef>& storages() const { return storages_; }
  /// Converts to an Object; `storage(i)` gives the bytes of storages()[i] (checked by the
  /// caller to hold at least numel elements). Tensors are bounds-checked against them.
  Object to_object(const std::function<at::Storage(std::size_t)>& storage) const;

  std::vector<PyNode> nodes;  // the arena; index 0 unused
  std::uint32_t root = 0;
  std::vector<StorageRef> storages_;
  std::string name;                // file, for messages
  std::uint64_t pickle_bytes = 0;  // from the PROTO op to STOP, inclusive
  std::uint64_t charged = 0;       // of the expansion budget, while reading
};

/// Reads one pickle starting at `start`; `end` receives the offset after its STOP.
/// @throws IoError naming the file and offset on anything not allowed or malformed.
Unpickled unpickle(const Input& bytes, std::uint64_t start, std::uint64_t& end);

/// Writes `object` as a protocol-2 pickle whose tensors refer to storages through persistent
/// ids ('storage', <Class>Storage, key, location, numel); `storages` receives, per key, the
/// tensor that owns the storage (keys "0", "1", ... in order of first use).
std::string pickle(const Object& object, std::vector<at::Tensor>& storages);

/// The torch.<Name>Storage class of a dtype ("FloatStorage"), nullopt for the dtypes torch
/// saves in a torch.storage.UntypedStorage (uint16, float8_*, complex32, ...).
std::optional<std::string> typed_storage_class(c10::ScalarType dtype);

/// What makes `t` other than a dense strided tensor ("a sparse_coo tensor", "a quantized
/// tensor", "a nested tensor"), or "" for a dense one: the files here hold dense tensors only.
std::string non_dense_kind(const at::Tensor& t);

}  // namespace treetensor::io::detail
