// safetensors reading and writing (safetensors.hpp): the reference reader's checks
// (safetensors/src/tensor.rs), one per field, each failure naming file, offset and tensor.
#include "treetensor/io/safetensors.hpp"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <set>
#include <vector>

#include "io/bytes.hpp"
#include "treetensor/tensor/construct.hpp"

namespace treetensor::io {
namespace {

using detail::Input;
using nlohmann::json;

constexpr std::uint64_t kMaxHeader = 100'000'000;  // the reference reader's limit

struct DtypeName {
  const char* name;
  c10::ScalarType dtype;
};
constexpr DtypeName kDtypes[] = {{"F64", c10::kDouble},
                                 {"F32", c10::kFloat},
                                 {"F16", c10::kHalf},
                                 {"BF16", c10::kBFloat16},
                                 {"I64", c10::kLong},
                                 {"I32", c10::kInt},
                                 {"I16", c10::kShort},
                                 {"I8", c10::kChar},
                                 {"U8", c10::kByte},
                                 {"BOOL", c10::kBool},
                                 {"F8_E4M3", c10::kFloat8_e4m3fn},
                                 {"F8_E5M2", c10::kFloat8_e5m2},
                                 {"U16", c10::kUInt16},
                                 {"U32", c10::kUInt32},
                                 {"U64", c10::kUInt64}};

struct Entry {
  std::string name;
  c10::ScalarType dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;
};

// Finds a key named twice in one object, in one linear SAX pass (nlohmann's parser keeps the
// last silently; its parse callback rescans containers, which is quadratic on wide headers).
class DuplicateKeys : public nlohmann::json_sax<json> {
 public:
  std::string duplicate;
  bool start_object(std::size_t) override { return open_.emplace_back(), true; }
  bool end_object() override { return open_.pop_back(), true; }
  bool key(string_t& k) override {
    if (!open_.back().insert(k).second && duplicate.empty()) duplicate = k;
    return true;
  }
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    error = e.what();
    return false;
  }
  std::string error;

 private:
  std::vector<std::set<std::string>> open_;
};

// The header JSON, refusing duplicate keys in any object.
json parse_header(const Input& file, std::string_view text) {
  json header;
  DuplicateKeys keys;
  try {
    if (!json::sax_parse(text.begin(), text.end(), &keys))
      file.fail(8, "the header is not valid UTF-8 JSON: " + keys.error);
    header = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    file.fail(8, std::string("the header is not valid UTF-8 JSON: ") + e.what());
  }
  if (!keys.duplicate.empty()) file.fail(8, "the header names '" + keys.duplicate + "' twice");
  if (!header.is_object()) file.fail(8, "the header is not a JSON object");
  return header;
}

c10::ScalarType dtype_of(const Input& file, const std::string& name, const json& d) {
  if (!d.is_string()) file.fail(8, "tensor '" + name + "': dtype is not a string");
  const auto text = d.get<std::string>();
  for (const auto& [n, t] : kDtypes)
    if (text == n) return t;
  file.fail(8, "tensor '" + name + "': unknown dtype '" + text + "'");
}

std::vector<Entry> entries_of(const Input& file, const json& header,
                              std::map<std::string, std::string>& metadata) {
  std::vector<Entry> out;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      if (!info.is_object()) file.fail(8, "__metadata__ is not an object");
      for (const auto& [k, v] : info.items()) {
        if (!v.is_string()) file.fail(8, "__metadata__ '" + k + "' is not a string");
        metadata[k] = v.get<std::string>();
      }
      continue;
    }
    auto bad = [&](const char* what) { file.fail(8, "tensor '" + name + "': " + what); };
    if (!info.is_object()) bad("not an object");
    if (!info.contains("dtype") || !info.contains("shape") || !info.contains("data_offsets"))
      bad("needs dtype, shape and data_offsets");
    Entry e{name, dtype_of(file, name, info["dtype"]), {}, 0, 0};
    if (!info["shape"].is_array()) bad("shape is not a list");
    for (const auto& d : info["shape"]) {
      if (!d.is_number_unsigned() || d.get<std::uint64_t>() > std::uint64_t(INT64_MAX))
        bad("a dimension is not a non-negative integer");
      e.shape.push_back(d.get<std::int64_t>());
    }
    const auto& offsets = info["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned())
      bad("data_offsets is not two non-negative integers");
    e.begin = offsets[0].get<std::uint64_t>();
    e.end = offsets[1].get<std::uint64_t>();
    if (e.end < e.begin) bad("data_offsets end before they begin");
    std::uint64_t bytes = c10::elementSize(e.dtype);
    for (auto d : e.shape)
      if (!detail::mul_ok(bytes, static_cast<std::uint64_t>(d), bytes))
        bad("its byte size overflows");
    if (bytes != e.end - e.begin)
      file.fail(8, "tensor '" + name + "': " + std::to_string(e.end - e.begin) +
                       " bytes in data_offsets, its dtype and shape need " + std::to_string(bytes));
    out.push_back(std::move(e));
  }
  return out;
}

// Offsets must tile the data exactly: from 0, no gap, no overlap, to the end of the file.
void check_layout(const Input& file, std::vector<Entry>& entries, std::uint64_t data_at) {
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t expected = 0;
  for (const auto& e : entries) {
    if (e.begin != expected)
      file.fail(data_at + std::min(e.begin, expected),
                "tensor '" + e.name + "' starts at data offset " + std::to_string(e.begin) + ", " +
                    (e.begin < expected ? "overlapping the tensor before it" : "leaving a gap") +
                    " (expected " + std::to_string(expected) + ")");
    expected = e.end;
  }
  if (data_at + expected != file.size)
    file.fail(data_at + expected, "the tensors use " + std::to_string(expected) +
                                      " bytes of data, the file holds " +
                                      std::to_string(file.size - data_at));
}

at::Tensor tensor_of(const Input& file, const Entry& e, std::uint64_t data_at) {
  const std::uint64_t at = data_at + e.begin, n = e.end - e.begin;
  Input view = file;
  if ((at % c10::elementSize(e.dtype)) != 0) view.views = false;  // misaligned: copied
  const at::Storage storage = view.storage(at, n);
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(e.dtype).device(storage.device()));
  std::vector<std::int64_t> strides(e.shape.size(), 1);
  for (std::size_t d = e.shape.size(); d-- > 1;)
    if (__builtin_mul_overflow(strides[d], std::max<std::int64_t>(e.shape[d], 1), &strides[d - 1]))
      file.fail(8, "tensor '" + e.name + "': its shape's strides overflow int64");
  t.set_(storage, 0, e.shape, strides);
  return t;
}

std::string name_of(c10::ScalarType t) {
  for (const auto& [n, d] : kDtypes)
    if (d == t) return n;
  throw std::invalid_argument(std::string("save_safetensors: safetensors has no name for dtype ") +
                              c10::toString(t));
}

}  // namespace

namespace detail {
SafetensorsFile safetensors_from_bytes(const Input& file, const LoadOptions& options) {
  Cursor c(file);
  const std::uint64_t n = c.le(8, "the header length");
  if (n > kMaxHeader) file.fail(0, "a header of " + std::to_string(n) + " bytes (at most 100 MB)");
  const std::string_view text = c.take(n, "the header");
  SafetensorsFile out;
  std::vector<Entry> entries = entries_of(file, parse_header(file, text), out.metadata);
  check_layout(file, entries, 8 + n);
  std::vector<std::pair<std::string, at::Tensor>> items;
  for (const auto& e : entries) {
    at::Tensor t = tensor_of(file, e, 8 + n);
    if (options.map_location) t = t.to(*options.map_location);
    items.emplace_back(e.name, std::move(t));
  }
  out.tensors = from_state_dict(items);
  return out;
}
}  // namespace detail

SafetensorsFile load_safetensors(const std::string& path, const LoadOptions& options) {
  return detail::safetensors_from_bytes(detail::map_file(path, options), options);
}

void save_safetensors(const std::string& path, const TensorTree& tensors,
                      const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  std::vector<at::Tensor> data;
  std::uint64_t offset = 0;
  for (const auto& [name, t] : to_state_dict(tensors)) {
    // A negative view's storage holds the values before the view: resolved.
    at::Tensor x = t.detach().cpu().resolve_neg().contiguous();
    const auto bytes = static_cast<std::uint64_t>(x.nbytes());
    header[name] = {{"dtype", name_of(x.scalar_type())},
                    {"shape", x.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(std::move(x));
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  detail::replace_file(path, [&](std::FILE* f) {
    char length[8];
    for (int k = 0; k < 8; ++k) length[k] = static_cast<char>((text.size() >> (8 * k)) & 0xff);
    std::fwrite(length, 1, 8, f);
    std::fwrite(text.data(), 1, text.size(), f);
    for (const auto& x : data)
      if (x.nbytes() > 0)
        std::fwrite(x.data_ptr(), 1, x.nbytes(), f);  // an empty tensor's pointer may be null
  });
}

}  // namespace treetensor::io
