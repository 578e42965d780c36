// treetensor-inspect FILE: what a checkpoint file (.pt / .pth from torch.save, or .safetensors)
// holds, in treetensor's tree layout — dtype, shape and bytes per tensor, the type (and short
// value) of every other leaf, totals — never a tensor's values. --json for scripts.
// Keys and strings come from the file: the listing shows their control characters escaped, so
// no file can forge listing lines or send sequences to the terminal.
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <iostream>
#include <map>

#include "treetensor/io/checkpoint.hpp"
#include "treetensor/io/safetensors.hpp"

namespace io = treetensor::io;
namespace tr = treetensor::tree;
using nlohmann::json;

namespace {

// Sums of many tensors' int64 counts: 128 bits cannot overflow.
struct Totals {
  std::size_t tensors = 0, others = 0;
  unsigned __int128 elements = 0, bytes = 0;
};

std::string count_text(unsigned __int128 n) {
  std::string s;
  do s.insert(s.begin(), static_cast<char>('0' + static_cast<int>(n % 10)));
  while ((n /= 10) != 0);
  return s;
}

// The length of the valid UTF-8 sequence at s[i] that is not a C1 control (U+0080..U+009F,
// which terminals obey too), or 0.
std::size_t printable_utf8(std::string_view s, std::size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const std::size_t n = c >= 0xf0 && c <= 0xf4 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 && c < 0xe0 ? 2 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return 0;
  const auto c1 = static_cast<unsigned char>(s[i + 1]);
  if (c == 0xc2 && c1 < 0xa0) return 0;                                  // C1 controls
  if ((c == 0xe0 && c1 < 0xa0) || (c == 0xf0 && c1 < 0x90)) return 0;    // overlong
  if ((c == 0xed && c1 >= 0xa0) || (c == 0xf4 && c1 >= 0x90)) return 0;  // surrogates, > U+10FFFF
  return n;
}

// Text from the file as the listing shows it: control characters, backslashes and bytes that
// are not printable UTF-8 escaped as in Python ("\n", "\x1b").
std::string escaped(std::string_view s) {
  std::string out;
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += s[i++];
    } else if (const std::size_t n = c >= 0x80 ? printable_utf8(s, i) : 0) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      static constexpr std::string_view named[] = {"\\n", "\\r", "\\t", "\\\\"};
      const std::size_t k = c == '\n' ? 0 : c == '\r' ? 1 : c == '\t' ? 2 : c == '\\' ? 3 : 4;
      out += k < 4 ? std::string(named[k]) : fmt::format("\\x{:02x}", c);
      ++i;
    }
  }
  return out;
}

std::string shape_text(const at::Tensor& t) {
  std::string s = "[";
  for (std::size_t d = 0; d < t.sizes().size(); ++d)
    s += (d ? ", " : "") + std::to_string(t.sizes()[d]);
  return s + "]";
}

// A non-tensor leaf: its Python type and, for short scalars, its value.
std::string other_text(const io::Value& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::monostate>)
          return "None";
        else if constexpr (std::is_same_v<T, bool>)
          return x ? "True" : "False";
        else if constexpr (std::is_same_v<T, std::int64_t> || std::is_same_v<T, double>)
          return fmt::format("{}", x);
        else if constexpr (std::is_same_v<T, std::complex<double>>)
          return fmt::format("({}{:+}j)", x.real(), x.imag());
        else if constexpr (std::is_same_v<T, std::string>)
          return x.size() <= 40 ? "'" + escaped(x) + "'" : fmt::format("str of {} bytes", x.size());
        else if constexpr (std::is_same_v<T, io::Bytes>)
          return fmt::format("{} bytes", x.data.size());
        else if constexpr (std::is_same_v<T, at::ScalarType>)
          return c10::toString(x);
        else if constexpr (std::is_same_v<T, at::Device>)
          return "'" + x.str() + "'";
        else
          return "";
      },
      v);
}

std::string leaf_text(const io::Object& o, const tr::Path& path, const io::Value& v,
                      Totals& totals) {
  if (const auto* t = std::get_if<at::Tensor>(&v)) {
    ++totals.tensors;
    totals.elements += static_cast<std::uint64_t>(t->numel());
    totals.bytes += t->nbytes();
    return fmt::format("{} {} {} {} B", o.parameters.count(path) ? "Parameter" : "Tensor",
                       c10::toString(t->scalar_type()), shape_text(*t), t->nbytes());
  }
  ++totals.others;
  return std::string(io::value_type_name(v)) + " " + other_text(v);
}

// treetensor's layout: a header per container, `key --> leaf` lines with the tree glyphs.
void print_node(const io::Object& o, const tr::Tree<io::Value>& node, tr::Path& path,
                const std::string& prefix, Totals& totals) {
  std::cout << "<" << io::container_name(o.kind(path)) << ">";
  std::size_t i = 0;
  for (const auto& [key, child] : node.children()) {
    const bool last = ++i == node.size();
    std::string shown;
    tr::Path::append_key(shown, key);
    std::cout << "\n" << prefix << (last ? "└── " : "├── ") << escaped(shown) << " --> ";
    path.push_back(key);
    if (child.is_leaf())
      std::cout << leaf_text(o, path, child.leaf(), totals);
    else
      print_node(o, child, path, prefix + (last ? "    " : "│   "), totals);
    path.pop_back();
  }
}

void collect_json(const io::Object& o, const tr::Tree<io::Value>& node, tr::Path& path, json& out) {
  if (node.is_leaf()) {
    json keys(path.keys());
    if (const auto* t = std::get_if<at::Tensor>(&node.leaf()))
      out["tensors"].push_back({{"path", keys},
                                {"dtype", c10::toString(t->scalar_type())},
                                {"shape", t->sizes().vec()},
                                {"bytes", t->nbytes()},
                                {"parameter", o.parameters.count(path) > 0}});
    else
      out["others"].push_back({{"path", keys},
                               {"type", io::value_type_name(node.leaf())},
                               {"value", other_text(node.leaf())}});
    return;
  }
  out["containers"].push_back(
      {{"path", json(path.keys())}, {"kind", io::container_name(o.kind(path))}});
  for (const auto& [key, child] : node.children()) {
    path.push_back(key);
    collect_json(o, child, path, out);
    path.pop_back();
  }
}

io::Object read(const std::string& file, std::string& format,
                std::map<std::string, std::string>& metadata) {
  // Tensors on the meta device: the data is never read, copied or mapped, so a checkpoint
  // larger than memory is listed as quickly as a small one.
  const auto structure_only = io::LoadOptions().device(c10::kMeta);
  if (std::filesystem::path(file).extension() == ".safetensors") {
    format = "safetensors";
    auto st = io::load_safetensors(file, structure_only);
    metadata = std::move(st.metadata);
    return io::to_object(st.tensors);
  }
  format = "torch.save";
  return io::load(file, structure_only);
}

int run(const std::string& file, bool as_json) {
  std::string format;
  std::map<std::string, std::string> metadata;  // safetensors' __metadata__
  const io::Object o = read(file, format, metadata);
  const auto file_bytes = std::filesystem::file_size(file);
  Totals totals;
  tr::Path path;
  if (as_json) {
    json out = {{"file", file},
                {"format", format},
                {"file_bytes", file_bytes},
                {"tensors", json::array()},
                {"others", json::array()},
                {"containers", json::array()}};
    collect_json(o, o.tree, path, out);
    for (const auto& t : out["tensors"]) {
      ++totals.tensors;
      totals.bytes += t["bytes"].get<std::uint64_t>();
    }
    // A sum past 2^64 stays exact as a decimal string; JSON readers take an integer otherwise.
    out["totals"] = {{"tensors", totals.tensors}};
    if (totals.bytes >> 64)
      out["totals"]["tensor_bytes"] = count_text(totals.bytes);
    else
      out["totals"]["tensor_bytes"] = static_cast<std::uint64_t>(totals.bytes);
    out["metadata"] = metadata;
    // Python strings may hold lone surrogates, which are not UTF-8: replaced, not fatal.
    std::cout << out.dump(2, ' ', false, json::error_handler_t::replace) << "\n";
    return 0;
  }
  std::cout << escaped(file) << " (" << format << ", " << file_bytes << " bytes)\n";
  if (o.tree.is_leaf())
    std::cout << leaf_text(o, path, o.tree.leaf(), totals);
  else
    print_node(o, o.tree, path, "", totals);
  std::cout << fmt::format(
      "\ntotal: {} tensors, {} elements, {} bytes of tensor data; {} other leaves\n",
      totals.tensors, count_text(totals.elements), count_text(totals.bytes), totals.others);
  for (const auto& [k, v] : metadata)
    std::cout << "metadata: " << escaped(k) << " = " << escaped(v) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "treetensor-inspect: the tree of a checkpoint file (torch.save .pt/.pth, or .safetensors): "
      "dtype, shape and bytes per tensor, never the values"};
  std::string file;
  bool as_json = false;
  app.add_option("FILE", file, "a torch.save file (zip or legacy format) or a .safetensors file")
      ->required();
  app.add_flag("--json", as_json, "one JSON object: tensors, other leaves, containers, totals");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(file, as_json);
  } catch (const c10::Error& e) {
    std::cerr << "treetensor-inspect: " << escaped(e.what_without_backtrace()) << "\n";
  } catch (const std::exception& e) {
    std::cerr << "treetensor-inspect: " << escaped(e.what()) << "\n";
  }
  return 1;
}
