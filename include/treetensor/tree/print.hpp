#pragma once
// Printing in treetensor's layout:
//   <Tree>
//   ├── a --> 1
//   └── x --> <Tree>
//       ├── c --> 3
//       └── d --> 4
// Multi-line leaf text continues under its arrow.

#include <cstddef>
#include <ostream>
#include <ranges>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "treetensor/tree/core.hpp"

namespace treetensor::tree {

/// How a leaf becomes text when no custom formatter is given: operator<< when T has one,
/// ranges as [a, b], tuples and pairs as (a, b).
template <class T>
void format_leaf(std::ostream& os, const T& value);

namespace detail {
template <class T>
concept Streamable = requires(std::ostream& os, const T& v) {
  os << v;
};
template <class T>
concept TupleLike = requires {
  std::tuple_size<T>::value;
};

inline void print_lines(std::ostream& os, std::string_view text, const std::string& indent) {
  std::size_t start = 0;
  for (;;) {
    const std::size_t nl = text.find('\n', start);
    os << text.substr(start, nl - start);
    if (nl == std::string_view::npos) return;
    os << '\n' << indent;
    start = nl + 1;
  }
}

// Iterative, so a tree of any depth prints (though the output grows with depth squared).
template <class T, class Fmt>
void print_node(std::ostream& os, const Tree<T>& root, std::string_view header, Fmt& fmt) {
  using Entry = typename Tree<T>::Entry;
  struct Frame {
    const Entry* it;
    const Entry* end;
    std::size_t mark;  // prefix length to restore when this subtree is done
  };
  std::string prefix;
  WalkStack<Frame> stack;
  os << header;
  const auto& top = root.children();
  stack.push({top.data(), top.data() + top.size(), 0});
  while (!stack.empty()) {
    Frame& f = stack.back();
    if (f.it == f.end) {
      prefix.resize(f.mark);
      stack.pop();
      continue;
    }
    const auto& [key, child] = *f.it++;
    const bool last = f.it == f.end;
    std::string shown;  // an empty key or one with '.' is quoted, as in paths (DESIGN.md §1)
    Path::append_key(shown, key);
    os << '\n' << prefix << (last ? "└── " : "├── ") << shown << " --> ";
    const std::size_t mark = prefix.size();
    prefix += last ? "    " : "│   ";
    if (child.is_leaf()) {
      std::ostringstream leaf;  // fresh per leaf: format flags set by fmt do not leak
      fmt(leaf, child.leaf());
      print_lines(os, leaf.str(), prefix + std::string(shown.size() + 5, ' '));
      prefix.resize(mark);
    } else {
      os << header;
      const auto& c = child.children();
      stack.push({c.data(), c.data() + c.size(), mark});
    }
  }
}
}  // namespace detail

template <class T>
void format_leaf(std::ostream& os, const T& value) {
  if constexpr (detail::Streamable<T>) {
    os << value;
  } else if constexpr (std::ranges::range<T>) {
    os << '[';
    bool first = true;
    for (const auto& v : value) {
      if (!first) os << ", ";
      first = false;
      format_leaf(os, v);
    }
    os << ']';
  } else if constexpr (detail::TupleLike<T>) {
    os << '(';
    std::apply(
        [&](const auto&... v) {
          std::size_t i = 0;
          ((os << (i++ ? ", " : ""), format_leaf(os, v)), ...);
        },
        value);
    os << ')';
  } else {
    static_assert(detail::Streamable<T>, "leaf type has no operator<<: pass a formatter");
  }
}

/// Writes `tree` in treetensor's layout: `header` on the first line (and after the arrow of
/// each subtree), then one line per key. `fmt(os, leaf)` formats a leaf; its extra lines are
/// indented under the arrow. A leaf root prints as the leaf alone.
template <class T, class Fmt>
void print(std::ostream& os, const Tree<T>& tree, std::string_view header, Fmt&& fmt) {
  if (tree.is_leaf()) {
    fmt(os, tree.leaf());
    return;
  }
  detail::print_node(os, tree, header, fmt);
}

/// print() with the header `<Tree>` and format_leaf().
template <class T>
std::ostream& operator<<(std::ostream& os, const Tree<T>& tree) {
  print(os, tree, "<Tree>", [](std::ostream& o, const T& v) { format_leaf(o, v); });
  return os;
}

/// The printed form as a string.
template <TreeLike A>
std::string to_string(const A& tree) {
  std::ostringstream os;
  os << tree;
  return os.str();
}

}  // namespace treetensor::tree
