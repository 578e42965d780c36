#pragma once
// Tree paths and the typed errors of the tree layer. Standard library only.

#include <compare>
#include <cstddef>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace treetensor::tree {

/// A path from the root of a tree to one of its nodes: the sequence of keys (DESIGN.md §1).
///
/// Its text form joins the keys with '.'; a key that contains '.' (or is empty) is written in
/// single quotes so that messages stay unambiguous. The root's path is empty and prints as
/// `<root>` in messages.
class Path {
 public:
  Path() = default;
  Path(std::initializer_list<std::string> keys) : keys_(keys) {}
  explicit Path(std::vector<std::string> keys) : keys_(std::move(keys)) {}

  /// Splits a dotted path ("x.c" → {"x", "c"}). The empty string is the root. Keys that
  /// contain '.' cannot be written this way: use the key-sequence form `Path{"a.b", "c"}`.
  static Path parse(std::string_view dotted) {
    Path p;
    if (dotted.empty()) return p;
    std::size_t start = 0;
    for (;;) {
      const std::size_t dot = dotted.find('.', start);
      p.keys_.emplace_back(dotted.substr(start, dot - start));
      if (dot == std::string_view::npos) return p;
      start = dot + 1;
    }
  }

  const std::vector<std::string>& keys() const noexcept { return keys_; }
  std::size_t size() const noexcept { return keys_.size(); }
  bool empty() const noexcept { return keys_.empty(); }
  const std::string& operator[](std::size_t i) const { return keys_[i]; }
  auto begin() const noexcept { return keys_.begin(); }
  auto end() const noexcept { return keys_.end(); }

  void push_back(std::string key) { keys_.push_back(std::move(key)); }
  void pop_back() { keys_.pop_back(); }
  /// This path extended by one key.
  Path operator/(std::string_view key) const {
    Path p = *this;
    p.keys_.emplace_back(key);
    return p;
  }

  /// Dotted text form; keys containing '.' or empty keys are single-quoted. "" for the root.
  std::string str() const {
    std::string out;
    for (std::size_t i = 0; i < keys_.size(); ++i) {
      if (i) out += '.';
      append_key(out, keys_[i]);
    }
    return out;
  }

  /// Like str(), but the root reads `<root>`: the form used in error messages.
  std::string describe() const { return keys_.empty() ? "<root>" : str(); }

  /// Appends one key in the quoting rule of str().
  static void append_key(std::string& out, std::string_view key) {
    if (key.empty() || key.find('.') != std::string_view::npos) {
      out += '\'';
      out += key;
      out += '\'';
    } else {
      out += key;
    }
  }

  friend bool operator==(const Path&, const Path&) = default;
  friend auto operator<=>(const Path&, const Path&) = default;

 private:
  std::vector<std::string> keys_;
};

/// Joins keys as `{a, b, x}` for messages.
inline std::string format_keys(const std::vector<std::string>& keys) {
  std::string out = "{";
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (i) out += ", ";
    Path::append_key(out, keys[i]);
  }
  return out + "}";
}

/// A key or path that does not exist in a tree (or runs through a leaf).
///
/// what() names the path that was asked for and the keys available where the lookup stopped.
class KeyError : public std::out_of_range {
 public:
  KeyError(Path path, std::vector<std::string> available, const std::string& what)
      : std::out_of_range(what), path_(std::move(path)), available_(std::move(available)) {}
  const Path& path() const noexcept { return path_; }
  const std::vector<std::string>& available() const noexcept { return available_; }

 private:
  Path path_;
  std::vector<std::string> available_;
};

/// Trees whose structures do not fit together (zip of different key sets, a leaf facing a
/// subtree without `inherit`, unflatten with the wrong number of leaves, ...).
///
/// what() names the path where the mismatch was found; for zips also the argument positions
/// and both key sets.
class StructureError : public std::invalid_argument {
 public:
  StructureError(Path path, const std::string& what)
      : std::invalid_argument(what), path_(std::move(path)) {}
  const Path& path() const noexcept { return path_; }

 private:
  Path path_;
};

}  // namespace treetensor::tree
