#pragma once
// What a checkpoint file holds, as a tree (DESIGN.md §11, §13): the io layer's value type.
//
// A file written by Python's torch.save holds a Python object: dicts (often OrderedDicts) with
// string or integer keys, lists, tuples, tensors, Parameters and Python scalars. `Object` keeps
// all of it in a tree::Tree<Value>: a dict's keys are tree keys (an integer key 3 becomes "3",
// remembered as an integer so that save() writes it back as one), a list's or tuple's items sit
// under "0", "1", ... in order, and every non-container value is a leaf. `kinds` remembers which
// internal nodes were not plain dicts, so save() writes OrderedDicts, lists and tuples back as
// such. load_tensors() / load_state_dict() (checkpoint.hpp) give the TreeTensor of the tensors
// alone.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <complex>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "treetensor/tensor/tree_tensor.hpp"
#include "treetensor/tree/tree.hpp"

namespace treetensor::io {

/// Python `bytes` (kept apart from `str`, which is UTF-8 text).
struct Bytes {
  std::string data;
  friend bool operator==(const Bytes&, const Bytes&) = default;
};

/// One leaf of a loaded file: None (monostate), bool, int (int64 range), float, complex, str
/// (UTF-8), bytes, a torch.dtype, a torch.device, or a tensor.
using Value = std::variant<std::monostate, bool, std::int64_t, double, std::complex<double>,
                           std::string, Bytes, at::ScalarType, at::Device, at::Tensor>;

/// The Python container an internal node came from (a node not listed in Object::kinds is a
/// plain dict).
enum class Container : std::uint8_t { dict, ordered_dict, list, tuple, set };

/// The Python type name of a container ("OrderedDict", "list", ...), for messages and tools.
const char* container_name(Container kind);

/// A whole file's content. `tree` holds the values; the maps hold what a tree cannot:
///  - kinds: containers other than dict, by path (lists, tuples, sets keep index keys "0".."n-1");
///  - int_keys: the paths whose last key was a Python int in its dict (optimizer state `0`);
///  - parameters: the paths of tensors that were `nn.Parameter`s;
///  - key_order: a dict's keys in the file's order, for each dict (plain or OrderedDict) whose
///    file order is not the tree's sorted order (DESIGN.md §1: trees iterate sorted). A state
///    dict keeps its module order ("conv.weight" before "bn.weight"), an optimizer state its
///    parameter ids as PyTorch numbered them (0, 1, ..., 10, not "0", "1", "10", "2").
///    save() writes a dict's keys in this order: the listed keys present in the tree first (in
///    the listed order, each once; listed keys no longer in the tree are skipped), then any
///    others sorted. A dict without an entry is written sorted.
/// An OrderedDict's `_metadata` attribute (module versions, written by `state_dict()`) is not
/// kept: PyTorch's `load_state_dict` accepts a state dict without it.
struct Object {
  tree::Tree<Value> tree;
  std::map<tree::Path, Container> kinds;
  std::set<tree::Path> int_keys;
  std::set<tree::Path> parameters;
  std::map<tree::Path, std::vector<std::string>> key_order;

  /// The container kind of the node at `path` (dict when not recorded).
  Container kind(const tree::Path& path) const;
  /// Every tensor leaf, at its path (other leaves left out; containers left without tensors
  /// become empty nodes). Shares the tensors.
  TreeTensor tensors() const;
};

/// An Object of nested dicts with the tensors of `t` (the form save() writes for a TreeTensor).
Object to_object(const TensorTree& t);

/// The Python type name of a leaf ("NoneType", "bool", "int", "float", "complex", "str",
/// "bytes", "torch.dtype", "torch.device", "Tensor").
const char* value_type_name(const Value& v);

}  // namespace treetensor::io
