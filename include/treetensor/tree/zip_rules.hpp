#pragma once
// The zip modes and their rules at one internal node, with their messages (DESIGN.md §2, §3),
// written once. Two walkers call them: the tree layer's zip_map (zip.hpp) and the tensor
// layer's one-walk zip (src/tensor/dispatch.cpp). Both keep their own fast path for the common
// case, equal key lists, and come here only when keys differ, a leaf is absent or a leaf faces
// a subtree; so these functions are plain and out of the hot loop.

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "treetensor/tree/internal_error.hpp"
#include "treetensor/tree/path.hpp"

namespace treetensor::tree {

/// How zip_map() matches the keys of several trees at each internal node (treevalue parity).
enum class ZipMode {
  strict,  ///< every tree must have the same keys (default)
  inner,   ///< the keys all trees have
  outer,   ///< the keys any tree has; absent leaves are filled from a missing value
  left,    ///< the first tree's keys; absent leaves are filled from a missing value
};

/// Options of zip_map(). `inherit` lets a leaf that faces a subtree in another argument be
/// broadcast into every leaf of that subtree; without it that is a StructureError, because
/// silently broadcasting changes results (DESIGN.md §2).
struct ZipOptions {
  ZipMode mode = ZipMode::strict;
  bool inherit = false;
};

/// The end of the StructureError message of a leaf facing a subtree without inherit: the C++
/// remedy (a binding without the option drops it).
inline constexpr std::string_view kInheritHint =
    "; pass inherit to broadcast the leaf into the subtree";

namespace detail {

/// The keys from the root to the node being zipped (pointers into the trees' own keys).
using Trail = std::vector<const std::string*>;

inline Path make_path(const Trail& trail) {
  std::vector<std::string> keys;
  keys.reserve(trail.size());
  for (const auto* k : trail) keys.push_back(*k);
  return Path(std::move(keys));
}

/// Who zips, for messages: the op the user called (it leads every message) and, when the
/// caller knows them, its arguments' names by zip position (a call may zip its arguments in
/// another order than its signature; then `names[pos]` is the signature's name), else
/// "argument <pos>".
struct ZipNames {
  std::string_view op = "zip";
  const std::string_view* names = nullptr;
  std::size_t count = 0;

  std::string arg(std::size_t pos) const {
    if (pos < count) return std::string(names[pos]);
    return "argument " + std::to_string(pos);
  }
  std::string prefix() const { return std::string(op) + ": "; }
};

/// The key lists of the internal nodes met at one zip node, with their argument positions.
struct KeySets {
  std::vector<std::vector<std::string>> keys;
  std::vector<std::size_t> positions;
};

/// @throws StructureError: the key lists of arguments `pa` and `pb` differ at `trail`.
[[noreturn]] inline void throw_key_mismatch(const Trail& trail, std::size_t pa,
                                            const std::vector<std::string>& ka, std::size_t pb,
                                            const std::vector<std::string>& kb,
                                            const std::string& tail = "", const ZipNames& n = {}) {
  Path here = make_path(trail);
  throw StructureError(here, n.prefix() + "key mismatch at '" + here.describe() +
                                 "': " + n.arg(pa) + " has keys " + format_keys(ka) + ", " +
                                 n.arg(pb) + " has keys " + format_keys(kb) + tail);
}

/// @throws StructureError: argument `leaf_pos` is a leaf where argument `tree_pos` is a subtree
/// with `tree_keys`, and inherit was not asked for.
[[noreturn]] inline void throw_leaf_faces_subtree(const Trail& trail, std::size_t leaf_pos,
                                                  std::size_t tree_pos,
                                                  const std::vector<std::string>& tree_keys,
                                                  const ZipNames& n = {}) {
  Path here = make_path(trail);
  throw StructureError(here, n.prefix() + "at '" + here.describe() + "' " + n.arg(leaf_pos) +
                                 " is a leaf but " + n.arg(tree_pos) + " is a subtree with keys " +
                                 format_keys(tree_keys) + std::string(kInheritHint));
}

/// @throws StructureError: argument `pos` has no leaf at `trail` and nothing fills it.
[[noreturn]] inline void throw_no_leaf(const Trail& trail, std::size_t pos,
                                       const ZipNames& n = {}) {
  Path here = make_path(trail);
  throw StructureError(here, n.prefix() + n.arg(pos) + " has no leaf at '" + here.describe() +
                                 "' and no missing value was given");
}

/// The keys to descend into at one internal node under `mode`: the first list (left), their
/// intersection (inner) or union (outer); strict throws on any difference. Without a missing
/// value (`can_fill` false) a key some argument lacks throws too. `sets` holds at least one
/// list; every list is sorted.
/// @throws StructureError naming the path, both argument positions and both key lists.
inline std::vector<std::string> merge_keys(const KeySets& sets, ZipMode mode, bool can_fill,
                                           const Trail& trail, const ZipNames& n = {}) {
  const auto& k = sets.keys;
  const auto& pos = sets.positions;
  TREETENSOR_INTERNAL_ASSERT(!k.empty() && k.size() == pos.size(), "one position per key list");
  std::vector<std::string> keys = k[0];
  for (std::size_t s = 1; s < k.size(); ++s) {
    if (k[s] == keys) continue;
    if (mode == ZipMode::strict) throw_key_mismatch(trail, pos[0], k[0], pos[s], k[s], "", n);
    std::vector<std::string> merged;
    if (mode == ZipMode::inner)
      std::set_intersection(keys.begin(), keys.end(), k[s].begin(), k[s].end(),
                            std::back_inserter(merged));
    if (mode == ZipMode::outer)
      std::set_union(keys.begin(), keys.end(), k[s].begin(), k[s].end(),
                     std::back_inserter(merged));
    if (mode != ZipMode::left) keys = std::move(merged);
  }
  if (can_fill) return keys;
  for (std::size_t s = 0; s < k.size(); ++s)
    if (!std::includes(k[s].begin(), k[s].end(), keys.begin(), keys.end()))
      for (std::size_t t = 0; t < k.size(); ++t)
        if (!std::includes(k[s].begin(), k[s].end(), k[t].begin(), k[t].end()))
          throw_key_mismatch(trail, pos[t], k[t], pos[s], k[s], " and no missing value was given",
                             n);
  return keys;
}

}  // namespace detail
}  // namespace treetensor::tree
